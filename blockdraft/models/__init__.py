"""Model adapters and checkpoints: the target, the drafter, their caches (kernels: ops/)."""
