"""Training a drafter: data, target features, the training loop, warm starts."""
