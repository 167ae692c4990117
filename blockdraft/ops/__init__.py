"""Kernels, as modules a model's own are swapped for (never methods patched on an instance):
packed linear layers (packed.py), fused RMSNorms (norms.py), attention sharing K/V heads
(attention.py), GGUF blocks (gguf_blocks.py) and int8 activations over them (int8_activations.py),
all over the C++ extension (few_rows.py, built by extension.py); which drafter dtype pays
(precision.py), and the switch back to transformers' own (switch.py). Imports nothing of the rest
of the package but errors.py."""
