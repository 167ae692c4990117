"""A GGUF weight kept in its quantized blocks, multiplied by the few-row kernel (issue 50).

A GGUF file stores a linear weight [N, K] as blocks of 32 weights along K, each with an fp16 scale
d (and, for Q4_1, an fp16 offset m): Q4_0 `d * (q - 8)`, Q4_1 `(d * q) + m`, Q8_0 `d * q`.
`pack_blocks` lays a weight's blocks out as the few-row kernel's panels of 16 output features
(`few_rows.py`), codes k-major and scales per block, and `block_linear` dequantizes them in
registers, exactly as the `gguf` package does, and sums each output in the order the fp32 kernel
sums it: bitwise the result of the fp32 kernel on the dequantized weight, at a fifth to a third of
the bytes to stream (4.5 to 8.5 bits a weight against 32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import few_rows

BLOCK = 32  # weights per block along the input features
# kind -> (bytes per block, the extension's kind number)
KINDS = {"Q4_0": (18, 0), "Q4_1": (20, 1), "Q8_0": (34, 2)}


@dataclass(frozen=True)
class BlockPanels:
    """A weight's blocks as `block_linear` reads them (`few_rows.NR` = 16 outputs a panel)."""

    kind: str  # "Q4_0", "Q4_1" or "Q8_0"
    codes: torch.Tensor  # [P, K, 8] uint8: two 4-bit codes a byte (outputs j and j + 8); Q8_0 [P, K, 16] int8
    d: torch.Tensor  # [P, K / 32, 16] fp16: each block's scale per output
    m: torch.Tensor | None  # Q4_1's offsets, shaped as d
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m) if t is not None)


def kind_name(qtype) -> str | None:
    """The block kind of a `gguf.GGMLQuantizationType` this kernel computes (None: not one)."""
    name = getattr(qtype, "name", str(qtype))
    return name if name in KINDS else None


def _panels(t: torch.Tensor, n: int) -> torch.Tensor:
    """Per-output rows [N, ...] -> [P, ..., 16]: rows grouped by 16 (zeros past N), outputs last."""
    p = -(-n // few_rows.NR)
    padded = t.new_zeros((p * few_rows.NR, *t.shape[1:]))
    padded[:n] = t
    grouped = padded.view(p, few_rows.NR, *t.shape[1:])  # [P, 16, ...]
    return grouped.movedim(1, -1).contiguous()  # [P, ..., 16]


def pack_blocks(raw, kind: str, out_features: int, in_features: int) -> BlockPanels:
    """A GGUF tensor's bytes (`ReaderTensor.data`: [N, K / 32 * block bytes] uint8, or anything
    numpy views as those bytes) -> its panels. Rows stay in the file's order."""
    if kind not in KINDS:
        raise ValueError(f"block kind {kind!r} is not one of {sorted(KINDS)}")
    if in_features % BLOCK:
        raise ValueError(f"a {kind} weight's input width must be a multiple of {BLOCK} (got {in_features})")
    size, _ = KINDS[kind]
    nb = in_features // BLOCK
    data = np.ascontiguousarray(np.asarray(raw)).view(np.uint8).reshape(out_features, nb, size)
    blocks = torch.from_numpy(data.copy())  # [N, nb, bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(out_features, nb)  # [N, nb]
    m = None
    if kind == "Q8_0":
        codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(out_features, in_features)  # [N, K]
    else:
        qs = blocks[..., 4 if kind == "Q4_1" else 2:]  # [N, nb, 16]: weight i low nibble, i + 16 high
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(out_features, in_features)  # [N, K] in 0..15
        if kind == "Q4_1":
            m = _panels(blocks[..., 2:4].contiguous().view(torch.float16).view(out_features, nb), out_features)
    codes = _panels(codes, out_features)  # [P, K, 16]
    if kind != "Q8_0":  # two outputs a byte: j in the low nibble, j + 8 in the high one
        codes = (codes[..., :8] | (codes[..., 8:] << 4)).contiguous()  # [P, K, 8]
    return BlockPanels(kind, codes, _panels(d, out_features), m, out_features, in_features)


def dequantize(panels: BlockPanels) -> torch.Tensor:
    """The fp32 weight [N, K] the blocks stand for, computed as `gguf` computes it (each product of
    an fp16 scale by a 4- or 8-bit code is exact, so this is what the kernel multiplies with)."""
    codes = panels.codes
    if panels.kind != "Q8_0":
        codes = torch.cat([codes & 0x0F, codes >> 4], dim=-1)  # [P, K, 16]: outputs 0-7 low nibbles, 8-15 high
    q = codes.float()
    if panels.kind == "Q4_0":
        q -= 8
    d = panels.d.float().repeat_interleave(BLOCK, dim=1)  # [P, K, 16]
    w = d * q
    if panels.m is not None:
        w += panels.m.float().repeat_interleave(BLOCK, dim=1)
    return w.transpose(1, 2).reshape(-1, panels.in_features)[: panels.out_features].contiguous()  # [N, K]


def block_linear(x: torch.Tensor, panels: BlockPanels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ the dequantized weight.T (+ bias): fp32 [..., N], bitwise what the fp32
    kernel gives on `gguf`'s dequantization of the same blocks."""
    rows = x.reshape(-1, x.shape[-1])
    empty = panels.d.new_empty(0)
    y = few_rows._load().block_linear(rows, panels.codes, panels.d, empty if panels.m is None else panels.m,
                                      panels.out_features, KINDS[panels.kind][1])  # [rows, N]
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], panels.out_features)
