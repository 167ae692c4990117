"""The opt-in faster mode of a GGUF target: activations quantized to int8 (issue 50, part 3).

The exact kernel (blocks512.cpp, few_rows.cpp) widens every weight to fp32 in registers, which is
what keeps a GGUF target's output bitwise its dequantized fp32 weights' output; at one row that
widening, not the memory, bounds it. llama.cpp instead quantizes each row of activations to int8
in blocks of 32 (one fp32 scale a block) and multiplies the weights' integer codes by them with
integer dot products, scaling only each block's sum. This mode does likewise (csrc/q8.cpp, with
AVX-512 VNNI: 64 products an instruction), so its results are close to the exact mode's, not
equal. Each row is quantized and summed alone, in one fixed order whatever the number of rows:
speculative decoding in this mode gives exactly this mode's plain greedy output.

`int8_activations(True)` (a context manager) or `use(True)` turns it on for every GGUF block
layer (the target's body and head: also the drafter's logits where it scores with the target's head
itself; a long prompt's prefill, which multiplies the dequantized fp32 weight, and the drafter's
own layers are unchanged). It needs a CPU with AVX-512 VNNI (`available`).
"""

from __future__ import annotations

import contextlib

import torch

from . import few_rows
from .gguf_blocks import KINDS, BlockPanels
from ..errors import BlockdraftError


class _Mode:
    on = False


MODE = _Mode()


def available() -> bool:
    """Whether this CPU runs the int8 kernel (AVX-512 with VNNI, the few-row extension built)."""
    return few_rows.available() and bool(few_rows.library().q8_usable())


def require(target=None) -> None:
    """A BlockdraftError where the mode cannot run: on this CPU, or (given a target.Target) on a
    target that does not compute from GGUF blocks (the mode would change nothing there)."""
    if target is not None and target.dense_loader is None:
        raise BlockdraftError(f"int8 activations quantize a GGUF target's activations: {target.name!r} does not "
                              "compute from GGUF blocks here")
    if not available():
        raise BlockdraftError("int8 activations need a CPU with AVX-512 VNNI and the few-row kernel; "
                              "this one runs the exact fp32 mode only")


def use(on: bool) -> None:
    """Turn the mode on or off for what follows (on: a BlockdraftError where it cannot run)."""
    if on:
        require()
    MODE.on = on


@contextlib.contextmanager
def int8_activations(on: bool = True):
    before = MODE.on
    use(on)
    try:
        yield
    finally:
        MODE.on = before


def vnni_codes(panels: BlockPanels) -> torch.Tensor:
    """The weight's codes laid out for the dot products (made once, kept beside the blocks)."""
    if panels.vnni is None:
        panels.vnni = few_rows.library().pack_vnni(panels.codes, KINDS[panels.kind].number)
    return panels.vnni


def block_linear(x: torch.Tensor, panels: BlockPanels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 times the blocks with x quantized to int8 per row and block of 32: fp32 [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    m = panels.m if panels.m is not None else panels.d.new_empty(0)
    y = few_rows.library().block_linear_q8(rows, vnni_codes(panels), panels.d, m, panels.out_features,
                                         KINDS[panels.kind].number)  # [rows, N]
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], panels.out_features)
