"""A GGUF weight kept in its quantized blocks, multiplied by the few-row kernel (issue 50).

A GGUF file stores a linear weight [N, K] as blocks along K: Q4_0, Q4_1 and Q8_0 blocks of 32
weights with an fp16 scale d (Q4_1 also an fp16 offset m): `d * (q - 8)`, `(d * q) + m`, `d * q`;
the K-quants super-blocks of 256 whose sub-blocks' scales are an fp16 times a 6- or 8-bit integer:
Q4_K `(d * sc) * q - dmin * mn` over sub-blocks of 32, Q6_K `(d * sc) * (q - 32)` over 16.
`pack_blocks` lays a weight's blocks out as the few-row kernel's panels of 16 output features
(`few_rows.py`), codes k-major and one scale (and offset) per span of k, and `block_linear`
dequantizes them in registers, exactly as the `gguf` package does, and sums each output in the
order the fp32 kernel sums it: bitwise the result of the fp32 kernel on the dequantized weight, at
a sixth to a third of the bytes to stream (5 to 10 bits a weight against 32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import few_rows


@dataclass(frozen=True)
class Kind:
    block: int  # weights per block along the input features (a K-quant's super-block: 256)
    nbytes: int  # bytes per block in the file
    number: int  # the extension's kind
    span: int  # weights sharing one scale (and offset) in the kernel


KINDS = {"Q4_0": Kind(32, 18, 0, 32), "Q4_1": Kind(32, 20, 1, 32), "Q8_0": Kind(32, 34, 2, 32),
         "Q4_K": Kind(256, 144, 3, 32), "Q6_K": Kind(256, 210, 4, 16)}


@dataclass(eq=False)
class BlockPanels:
    """A weight's blocks as `block_linear` reads them (`few_rows.NR` = 16 outputs a panel)."""

    kind: str  # a key of KINDS
    codes: torch.Tensor  # [P, K, 8] uint8: two 4-bit codes a byte (outputs j and j + 8); Q8_0, Q6_K [P, K, 16] int8
    d: torch.Tensor  # [P, K / span, 16]: each span's scale per output (fp16; the K-quants' fp32)
    m: torch.Tensor | None  # Q4_1's and Q4_K's offsets, shaped as d
    out_features: int
    in_features: int
    # the codes laid out for integer dot products (int8_activations.py), made at their first use
    vnni: torch.Tensor | None = field(default=None, repr=False)

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
    """A GGUF tensor's bytes (`ReaderTensor.data`: [N, K / block * block bytes] uint8, or anything
    numpy views as those bytes) -> its panels. Rows stay in the file's order."""
    if kind not in KINDS:
        raise ValueError(f"block kind {kind!r} is not one of {sorted(KINDS)}")
    spec = KINDS[kind]
    if in_features % spec.block:
        raise ValueError(f"a {kind} weight's input width must be a multiple of {spec.block} (got {in_features})")
    nb = in_features // spec.block
    data = np.ascontiguousarray(np.asarray(raw)).view(np.uint8).reshape(out_features, nb, spec.nbytes)
    blocks = torch.from_numpy(data.copy())  # [N, nb, bytes]
    codes, d, m = _UNPACK[kind](blocks)  # codes [N, nb, block]; d, m [N, nb, block / span]
    codes = _panels(codes.reshape(out_features, in_features), out_features)  # [P, K, 16]
    if codes.dtype == torch.uint8:  # two outputs a byte: j in the low nibble, j + 8 in the high one
        codes = (codes[..., :8] | (codes[..., 8:] << 4)).contiguous()  # [P, K, 8]

    def spans(t):
        return None if t is None else _panels(t.reshape(out_features, -1), out_features)  # [P, K / span, 16]

    return BlockPanels(kind, codes, spans(d), spans(m), out_features, in_features)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 stored at byte `at` of each block: [N, nb]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16)[..., 0]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> their low nibbles then their high ones [..., 2, n] (how a block of 32
    stores weights i and i + 16, and a Q4_K group of 32 bytes two sub-blocks)."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2)


def _unpack_q4_0(blocks):
    return _nibbles(blocks[..., 2:]).flatten(-2), _half(blocks, 0)[..., None], None


def _unpack_q4_1(blocks):
    return _nibbles(blocks[..., 4:]).flatten(-2), _half(blocks, 0)[..., None], _half(blocks, 2)[..., None]


def _unpack_q8_0(blocks):
    return blocks[..., 2:].contiguous().view(torch.int8), _half(blocks, 0)[..., None], None


def _unpack_q4_k(blocks):
    """Q4_K: fp16 d and dmin, 12 bytes of 6-bit sub-scales and sub-mins (decoded by the `gguf`
    package's own `Q4_K.get_scale_min`), then 4 groups of 32 bytes, each two sub-blocks of 32 (low
    nibbles, then high). A sub-block's weights are (d * sc) * q - dmin * mn, as `gguf` computes them."""
    from gguf.quants import Q4_K

    n, nb = blocks.shape[:2]
    sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12).numpy())  # [N * nb, 8] each
    d = _half(blocks, 0).float()[..., None] * torch.from_numpy(sc.astype(np.float32)).view(n, nb, 8)
    dm = _half(blocks, 2).float()[..., None] * torch.from_numpy(mn.astype(np.float32)).view(n, nb, 8)
    codes = _nibbles(blocks[..., 16:].reshape(n, nb, 4, 32)).reshape(n, nb, 256)
    return codes, d, -dm


def _unpack_q6_k(blocks):
    """Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 sub-scales, an fp16 d. The
    weight order follows `gguf`'s reshapes: per half of 128, low nibbles of its 64 bytes then
    their high ones; the highs, per half, four 2-bit planes of its 32 bytes. Weights are
    (d * sc) * (q - 32) over sub-blocks of 16; the codes are kept as q - 32 in int8."""
    n, nb = blocks.shape[:2]
    low = _nibbles(blocks[..., :128].reshape(n, nb, 2, 64)).reshape(n, nb, 256)
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)
    high = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)) & 3).reshape(n, nb, 256)
    codes = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8)
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, nb, 16]
    return codes, _half(blocks, 208).float()[..., None] * scales, None


_UNPACK = {"Q4_0": _unpack_q4_0, "Q4_1": _unpack_q4_1, "Q8_0": _unpack_q8_0, "Q4_K": _unpack_q4_k,
           "Q6_K": _unpack_q6_k}


def dequantize(panels: BlockPanels) -> torch.Tensor:
    """The fp32 weight [N, K] the blocks stand for, computed as `gguf` computes it (d * q is exact
    for the 4-bit kinds, and one rounding for the 8-bit ones: what the kernel multiplies with); in
    one pass by the extension where it has AVX-512 (a long prompt's prefill makes each weight),
    else by torch's ops (`dequantize_torch`), bitwise the same."""
    ext = few_rows.library() if panels.codes.device.type == "cpu" else None
    if ext is not None and ext.dequantize_usable():
        m = panels.d.new_empty(0) if panels.m is None else panels.m
        return ext.block_dequantize(panels.codes, panels.d, m, panels.out_features, KINDS[panels.kind].number)
    return dequantize_torch(panels)


def dequantize_torch(panels: BlockPanels) -> torch.Tensor:
    """`dequantize` by torch's ops, on any device."""
    codes = panels.codes
    if codes.dtype == torch.uint8:  # 4-bit codes, two a byte
        codes = torch.cat([codes & 0x0F, codes >> 4], dim=-1)  # [P, K, 16]: outputs 0-7 low nibbles, 8-15 high
    q = codes.float()
    if panels.kind == "Q4_0":
        q -= 8
    span = KINDS[panels.kind].span
    w = panels.d.float().repeat_interleave(span, dim=1) * q  # [P, K, 16]
    if panels.m is not None:
        w += panels.m.float().repeat_interleave(span, dim=1)
    return w.transpose(1, 2).reshape(-1, panels.in_features)[: panels.out_features].contiguous()  # [N, K]


def block_linear(x: torch.Tensor, panels: BlockPanels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ the dequantized weight.T (+ bias): fp32 [..., N], bitwise what the fp32
    kernel gives on `gguf`'s dequantization of the same blocks."""
    rows = x.reshape(-1, x.shape[-1])
    empty = panels.d.new_empty(0)
    y = few_rows.library().block_linear(rows, panels.codes, panels.d, empty if panels.m is None else panels.m,
                                      panels.out_features, KINDS[panels.kind].number)  # [rows, N]
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], panels.out_features)
