"""A linear kernel for the few rows of a decode step, fp32 on x86 CPUs with AVX2 and FMA
(`csrc/few_rows.cpp`, built by `make setup` or at the first use: extension.py).

Why our own: a decode step multiplies 1 to 32 rows by every weight of the model. At one row that
is a stream of the weights from memory, and oneDNN's packed kernel and PyTorch's default one read
them at about two thirds of the memory's speed; at sixteen rows it is arithmetic, where both reach
about half of what the cores do on a large GEMM. This kernel reads each weight once per call, in
panels of 16 output features laid out in the order it reads them, and multiplies every row by a
panel while it is in the core's cache. On a 2-core EPYC (AVX2), SmolLM2's 30 layers of linear
weights take 16 ms at one row and 33 ms at sixteen, against 26 and 45 ms packed by oneDNN
(`python scripts/forward_cost.py --linear`).

Each output is one accumulator over the input features in order, whatever the number of rows and
wherever a row falls in a tile: a row's result is bitwise the same in a one-token forward and in a
block of 16, so a verify forward's linear layers compute exactly what plain decoding's do.

The same extension holds the other kernels of a step's few rows: bf16- and int8-stored panels
(`pack(w, torch.bfloat16)`, `pack(w, torch.int8)` with a scale per output feature, widened exactly
and computed in fp32: the drafter's weights at a half or a quarter of the bytes,
`precision.draft_precision`), an RMSNorm in one pass (`rms_norm`, norms.py), the drafter's per-head
norm and RoPE in one pass (`norm_rope`): at a few rows PyTorch's eight-odd small ops per norm cost
their dispatch, not their arithmetic (`python scripts/forward_cost.py --norms`, `--draft`); and the
attention of a step's few query rows (`attention`: the target's through `attention._shared_kv_sdpa`,
the drafter's in draft.py), which reads each K/V head once for the query heads that share it, in
place in the cache, where transformers' unmasked one-token call copied K/V per query head
(`python scripts/forward_cost.py --attention`). Its rows too are computed alone: a row's output
depends only on its query and the keys it may see.

`available()` says whether the kernel can run here; it returns False (once, with a warning) where
the compiler, the instructions or the build are missing, and packed.py then packs for oneDNN
as before. BLOCKDRAFT_FEW_ROWS=0 turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import extension

NR = 16  # output features per panel (csrc/few_rows.cpp)
MAX_ROWS = 256  # calls of more rows (a long prompt's prefill) run the default kernel
_NONE = torch.empty(0)  # the extension's "no tensor": float panels' scales, an unmasked attention's mask


def available() -> bool:
    """Whether the kernels are built and this CPU runs them (extension.py)."""
    return library() is not None


def library():
    """The extension's module, whose functions this module wraps (None where it does not run)."""
    return extension.load()


def runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether layers of this device and dtype run the kernel."""
    return device.type == "cpu" and dtype == torch.float32 and available()


def applies(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and runs_on(weight.device, weight.dtype)


@dataclass(frozen=True)
class Int8Panels:
    """A weight's panels in int8 with one fp32 scale per output feature (symmetric, per row:
    w[n, k] ~ scales[n] * data[p, k, j] for n = 16 p + j); `linear` widens the int8 exactly,
    sums in fp32 and multiplies each output by its scale once."""

    data: torch.Tensor  # [ceil(N / 16), K, 16] int8
    scales: torch.Tensor  # [ceil(N / 16) * 16] fp32 (zeros past N)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], fp32 scales [N]): each row scaled so its largest magnitude is
    127 (a row of zeros keeps scale 0), rounded to nearest."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    q = w / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None]  # a row of zeros stays zeros
    return q.round().clamp(-127, 127).to(torch.int8), scales


def pack(weight: torch.Tensor, storage: torch.dtype | None = None) -> torch.Tensor | Int8Panels:
    """weight [N, K] -> panels [ceil(N / 16), K, 16] (zero rows past N), the layout `linear` reads.
    storage=torch.bfloat16: the panels hold the weight rounded to bf16, half the bytes to stream;
    storage=torch.int8: the weight quantized per output feature (`quantize_int8`), a quarter of the
    bytes, with its scales (`Int8Panels`). `linear` widens either exactly and computes in fp32 (for
    the drafter, whose numerics cannot change the output)."""
    if storage not in (None, torch.float32, torch.bfloat16, torch.int8):
        raise ValueError(f"few-row panels are stored in float32, bfloat16 or int8, not {storage}")
    if storage == torch.int8:
        q, scales = quantize_int8(weight)
        data = library().pack(q.contiguous())
        padded = torch.zeros(data.shape[0] * NR, dtype=torch.float32, device=weight.device)
        padded[: len(scales)] = scales
        return Int8Panels(data, padded)
    return library().pack(weight.detach().to(storage or weight.dtype).contiguous())


def linear(x: torch.Tensor, panels: torch.Tensor | Int8Panels, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) from the weight's panels (fp32, bf16 or int8); fp32 [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(panels, Int8Panels):
        y = library().linear(rows, panels.data, out_features, panels.scales)  # [rows, N]
    else:
        y = library().linear(rows, panels, out_features, _NONE)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2, -1) + eps)) of fp32 rows in one pass (csrc/few_rows.cpp), each
    row independent of the others; `x`'s shape."""
    return library().rms_norm(x, weight, eps)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm then rotary embedding (rotate-half) in one pass: fp32 x [B, T, heads, D],
    cos/sin [1 or B, T, D] -> [B, heads, T, D] (csrc/few_rows.cpp)."""
    return library().norm_rope(x, weight, eps, cos, sin)


def attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `attention` takes these fp32 CPU tensors: one head size for q, k and v, a multiple of 8
    up to 512, and whole groups of query heads per K/V head."""
    d = q.shape[-1]
    return q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and d % 8 == 0 \
        and d <= 512 and k.shape[-1] == v.shape[-1] == d and k.shape[1] == v.shape[1] \
        and q.shape[1] % k.shape[1] == 0 and available()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              scale: float | None = None) -> torch.Tensor:
    """Softmax attention of a step's few query rows, fp32: q [B, Hq, T, D] against k and v
    [B, Hkv, S, D] (a cache's views: only D must be contiguous; Hq / Hkv query heads share each
    K/V head), `mask` [B, 1 or Hq, T, S] bool (True = may attend; None: every row sees every
    key). Returns [B, T, Hq, D]. A row's visible keys are read in order and nothing else enters its
    sums: its output equals the same query decoded alone against those keys (csrc/few_rows.cpp)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return library().attention(q, k, v, _NONE if mask is None else mask, float(scale))


def rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, cos: torch.Tensor,
                sin: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, n: int) -> torch.Tensor:
    """A layer's rotary embedding and cache append in one pass (csrc/rope_cache.cpp): fp32 q, k, v
    [B, T, H * D] (rows contiguous), cos/sin [1 or B, T, D]; rope(k) and v go into the buffers
    [B, Hk, capacity, D] at slots n .. n + T - 1; returns rope(q) [B, Hq, T, D], bitwise transformers'
    `apply_rotary_pos_emb`."""
    return library().rope_append(q, k, v, head_dim, cos, sin, kbuf, vbuf, n)
