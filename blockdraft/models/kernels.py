"""Prepacked linear layers for the CPU: the one kernel change the fast forward makes.

Where it runs (fp32, x86 with AVX2 and FMA, a C++ compiler), a layer's weight is packed for our
few-row kernel (few_rows.py), which reads the weights at memory speed at one row and keeps every
output row bitwise independent of the row count; calls of more than `few_rows.MAX_ROWS` rows run
the default kernel. Elsewhere the weight is packed for oneDNN, as follows.

PyTorch's default fp32 `nn.Linear` on the CPU repacks its weight on every call with more than
one row, so a forward over two tokens cost about what two forwards cost (SmolLM2's LM head:
8.6 ms at one row, 20.4 ms at two). oneDNN can pack a weight once (`_reorder_linear_weight`)
and multiply any number of rows against the packed copy (`_linear_pointwise`, what inductor's
CPU freezing emits): 5.1 ms at one row, 5.0 ms at two, 11.0 ms at sixteen (command:
`python -m blockdraft.models.kernels`).

It also makes each output row bitwise independent of how many rows are multiplied with it,
which the default kernel is not (one row and three rows round differently).

On some CPUs the default kernel is the faster one at one or two rows (on an AVX-512 Xeon: a
576 x 1536 layer takes 30 us at one row against 47 us packed, while at 16 rows packed takes 106 us
against 149). So each weight shape measures once per process, at its first call, which kernel is
faster at 1 to 8 rows (`small_rows`, over weights streamed from memory as in a forward, not one
weight kept in the cache, where the default kernel looks faster than it is), and calls below the
first count where the default is not 10% faster run the default kernel: plain decoding then
computes exactly what transformers computes, and larger verify forwards run packed. Either way a
block's rows round differently from one-token rows, by ~1e-7, as attention's do; greedy output is
checked against plain decoding on real prompts.

`prepack(module)` swaps the forward of every `nn.Linear` under `module` for the packed one,
in place, without touching the model's source. Where packing does not apply (CUDA, fp16, a
layer being trained) the layer runs as it always did. `use_packed(False)` (a context manager)
runs the original layers again, and transformers' own attention, for baselines that must be what
transformers does by itself.

The other change is in attention (`share_kv_heads`): transformers' SDPA path copies a
grouped-query layer's whole K/V cache once per query-head group before every call that has a
mask, because PyTorch's CUDA kernels do not share heads under a mask. The CPU kernel does, with
the same result bit for bit, and every batch step and tree verify has a mask: SmolLM2 (3 K/V heads
for 9 query heads) copied 3x its cache per layer, the largest single cost of a step of 16
sequences (`python scripts/batch_forward.py`).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from . import few_rows
from .cpu import cpu_flags

_STATE = threading.local()
PACK_HINT = 16  # rows the packing is laid out for; rows stay bitwise consistent at every count (tested)
SMALL_ROWS_TRIED = 8  # the default kernel may take calls of up to this many rows, where it measures faster
SMALL_ROWS: dict[tuple, int] = {}  # (in, out, dtype, threads) -> rows below which the default kernel runs
# A drafter's calls of more rows than this run oneDNN's bf16 kernels where the CPU has bf16
# instructions: cold, the bundled drafter's linear layers and head took 2.41 / 2.92 ms at 8 rows
# (int8 panels / oneDNN bf16), 3.73 / 3.61 at 16, 5.28 / 4.52 at 24, 13.35 / 8.62 at 64 on a 2-core
# EPYC with AVX512-BF16 (`python scripts/forward_cost.py --draft-linear --tokens 4,8,16,24,32,64,128`).
MANY_ROWS = 16


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:  # oneDNN packs bf16 only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def packed_kernel(device: torch.device, dtype: torch.dtype) -> str | None:
    """Which kernel prepacked layers of this device and dtype run: "few-row", "oneDNN" or None."""
    if few_rows.runs_on(device, dtype):
        return "few-row"
    return "oneDNN" if packing_available(device, dtype) else None


@contextlib.contextmanager
def use_packed(enabled: bool):
    """Within the block, prepacked layers run packed and masked attention shares K/V heads (True), or
    both run as transformers runs them (False)."""
    before = _packed_enabled()
    _STATE.enabled = enabled
    try:
        yield
    finally:
        _STATE.enabled = before


def _packed_enabled() -> bool:
    """False within `use_packed(False)` (in this thread)."""
    return _STATE.__dict__.get("enabled", True)


class _PackedForward:
    """The forward of one `nn.Linear`, against a oneDNN-packed copy of its weight. The copy is
    made again when the weight changed since (in place, by an optimizer step or a load, or by a
    move or cast), so a packed layer never computes with stale weights."""

    def __init__(self, linear: nn.Linear, storage: torch.dtype | None = None):
        self.linear = linear
        self.storage = storage  # the few-row panels' dtype (bf16: the drafter's weights, see `prepack`)
        self.original = linear.forward
        self.key = None
        self.packed = None  # oneDNN's packed copy
        self.panels = None  # or few_rows.py's, where that kernel runs (then no oneDNN copy but `many`)
        self.many = None  # a drafter's oneDNN bf16 copy for calls of many rows (MANY_ROWS), made at the first
        self.bf16_many = False  # whether such calls run it: a drafter's panels (`storage`) on a CPU with bf16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        if not _packed_enabled() or x.dtype != w.dtype or (
                torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return self.original(x)
        # inference tensors have no version counter (and change in place only inside inference mode)
        key = (w.data_ptr(), -1 if w.is_inference() else w._version, w.dtype, w.device)
        if key != self.key:
            self.packed = self.panels = self.many = None
            if few_rows.applies(w):
                self.panels = few_rows.pack(w, self.storage)
                self.bf16_many = self.storage is not None and native_bf16_packing(w.device)
            elif packing_available(w.device, w.dtype):
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT)
            else:
                return self.original(x)
            self.key = key
        rows = x.numel() // x.shape[-1]
        if self.panels is not None:
            if rows > MANY_ROWS and self.bf16_many:
                return self._many_rows(x)
            if rows > few_rows.MAX_ROWS:
                return self.original(x)
            bias = self.linear.bias
            return few_rows.linear(x, self.panels, w.shape[0], None if bias is None else bias.detach())
        if rows < small_rows(w, self.packed):
            return self.original(x)
        return self._packed(x)

    def _many_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A drafter's call of many rows (a batch's blocks, a prompt's context) in oneDNN's bf16
        arithmetic, which outruns the few-row panels there; its numerics cannot change the output."""
        if self.many is None:
            self.many = torch.ops.mkldnn._reorder_linear_weight(self.linear.weight.detach().bfloat16(), PACK_HINT)
        return self._onednn(x.bfloat16(), self.many).to(x.dtype)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return self._onednn(x, self.packed)

    def _onednn(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """x [..., K] against a oneDNN-packed copy of the weight in x's dtype -> [..., N]."""
        bias = self.linear.bias
        y = _onednn(x.reshape(-1, x.shape[-1]), packed, None if bias is None else bias.detach().to(x.dtype))
        return y.view(*x.shape[:-1], self.linear.weight.shape[0])  # [..., N]


def small_rows(weight: torch.Tensor, packed: torch.Tensor) -> int:
    """Rows below which the default kernel runs for weights of this shape: measured once per
    process (both kernels at 1..SMALL_ROWS_TRIED rows, median of 3 sweeps each); the default
    kernel keeps a row count only where it is at least 10% faster, and only from one row up.

    Each sweep runs the kernel over enough distinct weights of this shape to overflow the CPU's
    last-level cache (`STREAM_BYTES`), as a forward does: a model's weights (SmolLM2's body is
    424 MB) stream from memory, while one weight called again and again stays in the cache, where
    the default kernel looked faster at one row than it is in a forward (on a 2-core EPYC with a
    32 MB L3, 576 x 576 at one row: 32.7 us in the cache against 49.9 packed, 96.2 streamed
    against 76.4; `python -m blockdraft.models.kernels`)."""
    key = (weight.shape[1], weight.shape[0], weight.dtype, torch.get_num_threads())
    if key not in SMALL_ROWS:
        with torch.inference_mode():
            SMALL_ROWS[key] = _measure_small_rows(*_streamed(weight, packed))  # packed: None packs it here
    return SMALL_ROWS[key]


STREAM_BYTES = 64 << 20  # weights each kernel sweeps while measured: twice the L3 of the CPUs we measured on
STREAM_COPIES = 256  # at most this many weights (tiny layers reach STREAM_BYTES no other way)


def _streamed(weight: torch.Tensor, packed: torch.Tensor | None) -> tuple[list, list]:
    """`weight` and its packed copy, with weights of its shape filled with a constant (and their
    packed copies) beside it up to STREAM_BYTES: alone when it is that large by itself (an LM head), since then
    it cannot stay in a cache, and copies of it would only take memory."""
    weight = weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT) if packed is None else packed
    copies = min(STREAM_COPIES, -(-STREAM_BYTES // (weight.numel() * weight.element_size())))
    others = [torch.full_like(weight, 0.01) for _ in range(copies - 1)]  # written, so really in memory
    return [weight, *others], [packed, *(torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT) for w in others)]


def _per_call(sweep, calls: int) -> float:
    """Seconds a call: the median of 3 timed `sweep`s (after one untimed) of `calls` calls each."""
    import time

    sweep()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        sweep()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1] / calls


def _default(x, w):
    return torch.nn.functional.linear(x, w)


def _onednn(x, packed, bias=None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _measure_small_rows(weights: list, packs: list) -> int:
    keep = 0
    for rows in range(1, SMALL_ROWS_TRIED + 1):
        x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)
        plain = _per_call(lambda: [_default(x, w) for w in weights], len(weights))
        onednn = _per_call(lambda: [_onednn(x, p) for p in packs], len(packs))
        if plain > 0.9 * onednn:
            break
        keep = rows
    return keep + 1


def kernel_timings(weight: torch.Tensor, rows: int) -> dict:
    """Microseconds a call of each kernel at `rows` rows, with one weight kept in the cache and with
    weights streamed from memory (what `small_rows` measures): the figures its docstring quotes."""
    weights, packs = _streamed(weight, None)
    n = len(weights)
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    us = lambda sweep: round(1e6 * _per_call(sweep, n), 1)  # noqa: E731
    with torch.inference_mode():
        return {"cached_default": us(lambda: [_default(x, weights[0]) for _ in range(n)]),
                "cached_packed": us(lambda: [_onednn(x, packs[0]) for _ in range(n)]),
                "streamed_default": us(lambda: [_default(x, w) for w in weights]),
                "streamed_packed": us(lambda: [_onednn(x, p) for p in packs])}


def prepack(module: nn.Module, storage: torch.dtype | None = None) -> int:
    """Give every `nn.Linear` under `module` the packed forward (idempotent; the packing itself
    happens at each layer's first call); returns how many layers now have it. storage=torch.bfloat16
    or torch.int8: where the few-row kernel runs, the layers' panels hold their weights rounded to
    bf16 or quantized to int8 (computed in fp32; only for a model whose numerics cannot change the
    output: the drafter)."""
    count = 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            current = layer.__dict__.get("forward")
            if not isinstance(current, _PackedForward):
                layer.forward = _PackedForward(layer, storage)
            elif current.storage != storage:
                current.storage, current.key = storage, None  # packed again at the next call
            count += 1
    return count


def unpack(module: nn.Module) -> None:
    """Undo `prepack` (e.g. before moving or casting the module)."""
    for layer in module.modules():
        current = layer.__dict__.get("forward")
        if isinstance(current, _PackedForward):
            del layer.forward


def is_packed(layer: nn.Module) -> bool:
    return isinstance(layer.__dict__.get("forward"), _PackedForward)


SHARED_KV_ATTENTION = "blockdraft_sdpa"  # the name our attention function is registered under


def _shared_kv_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                    **kwargs):
    """transformers' SDPA attention, except that a masked call of a grouped-query layer on the CPU
    lets the kernel share each K/V head among its query heads (`enable_gqa`) instead of repeating
    K/V first. query [B, Hq, T, D], key/value [B, Hkv, S, D]; returns [B, T, Hq, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if few_row_attention_applies(query, key, value, attention_mask, dropout, kwargs):
        mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]  # [B, 1, T, S]
        return few_rows.attention(query, key, value, mask, scaling), None
    if attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1 or key.device.type != "cpu" \
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions") \
            or not _packed_enabled():  # use_packed(False): transformers as it is
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask[:, :, :, : key.shape[-2]]  # [B, 1, T, S]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def few_row_attention_applies(query, key, value, attention_mask, dropout, kwargs) -> bool:
    """Whether a transformers attention call is one `few_rows.attention` computes as SDPA would: a
    step's few fp32 rows on the CPU, a bool mask (or a single row seeing the whole cache), no
    dropout, no position bias. Every decode step's attention then runs it, one token or a block,
    so a block's rows compute what one-token rows do; a prompt's prefill keeps SDPA."""
    rows = query.shape[2]
    return _packed_enabled() and rows <= few_rows.MAX_ROWS and not dropout \
        and kwargs.get("position_bias") is None and not kwargs.get("output_attentions") \
        and (attention_mask.dtype == torch.bool if attention_mask is not None else rows == 1) \
        and few_rows.attention_fits(query, key, value)


def share_kv_heads(model: nn.Module) -> bool:
    """Switch a transformers model that runs SDPA attention to `_shared_kv_sdpa` (its masks are
    made as SDPA's). Models on another attention implementation keep it. True if switched."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation") \
            or _branches_on_sdpa(model):
        return False
    AttentionInterface.register(SHARED_KV_ATTENTION, _shared_kv_sdpa)
    AttentionMaskInterface.register(SHARED_KV_ATTENTION, sdpa_mask)
    model.set_attn_implementation(SHARED_KV_ATTENTION)
    return config._attn_implementation == SHARED_KV_ATTENTION


def _branches_on_sdpa(model: nn.Module) -> bool:
    """Whether the model's own source names "sdpa" (DeepSeek-V3.2's sparse attention, gpt-oss's
    sinks, Qwen3.5 ... decide what they compute by the implementation's name): such a model keeps
    SDPA under its own name, or another name would change what it computes."""
    import inspect
    import sys

    for name in {type(m).__module__ for m in model.modules()}:
        if name.startswith("torch."):
            continue
        module = sys.modules.get(name)
        if module is None:
            return True
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            return True  # unknown: keep what transformers chose
        if '"sdpa"' in source or "'sdpa'" in source:
            return True
    return False


def fast_draft_dtype(device: torch.device, target_dtype: torch.dtype) -> torch.dtype:
    """The drafter's dtype for `--draft-dtype auto`: bf16 on CUDA; on a CPU where the few-row kernel
    runs, int8 weights computed in fp32 (`draft_precision`: a draft step streams a quarter of fp32's
    bytes; on a 2-core EPYC the bundled drafter's cold block-4 step took 2.5 ms against 3.5 with
    bf16 weights, for 0.4-0.6% of tau, docs/step-cost.md); on another CPU with native bf16
    instructions (AVX512-BF16 or AMX) that oneDNN packs for, bf16; else the target's dtype (bf16
    arithmetic emulated is slower: on an AVX2-only CPU the bundled drafter's block-16 forward took
    81 ms in bf16 against 19 ms in fp32)."""
    if device.type == "cuda":
        return torch.bfloat16
    if few_rows.runs_on(device, torch.float32):
        return torch.int8
    return torch.bfloat16 if native_bf16_packing(device) else target_dtype


def native_bf16_packing(device: torch.device) -> bool:
    """Whether oneDNN computes bf16 natively on this device (a CPU with bf16 instructions)."""
    return device.type == "cpu" and native_cpu_bf16() and torch.backends.mkldnn.is_available() \
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def draft_precision(device: torch.device, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype | None]:
    """(compute dtype, few-row weight storage or None) of a drafter asked to run in `dtype`. bf16 on
    a CPU where the few-row kernel runs: the linear layers' weights rounded to bf16 (half the bytes a
    step streams) and everything computed in fp32, even where the CPU has bf16 instructions: a
    draft step's few rows are a stream of weights, and oneDNN's bf16 kernels took 4.5 ms for the
    bundled drafter's cold block-4 step on a 2-core EPYC with AVX512-BF16, against 3.5 for these
    panels (`python scripts/forward_cost.py --draft --cold`). int8: the weights quantized per output
    feature (a quarter of the bytes), computed in fp32; only where the few-row kernel runs."""
    if dtype == torch.int8:
        if not few_rows.runs_on(device, torch.float32):
            from ..errors import BlockdraftError

            raise BlockdraftError("int8 drafter weights need the few-row kernel: an x86 CPU with AVX2 and FMA and "
                                  "a C++ compiler (choose another --draft-dtype)")
        return torch.float32, torch.int8
    if dtype == torch.bfloat16 and few_rows.runs_on(device, torch.float32):
        return torch.float32, torch.bfloat16
    return dtype, None


def native_cpu_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (Linux: read from /proc/cpuinfo)."""
    flags = cpu_flags() or set()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _main() -> None:  # python -m blockdraft.models.kernels: the timings quoted above, on this machine
    from .profile import timed

    torch.manual_seed(0)
    lin = nn.Linear(576, 49152, bias=False)
    packed = nn.Linear(576, 49152, bias=False)
    packed.load_state_dict(lin.state_dict())
    prepack(packed)

    def ms(fn):
        fn()  # the first call packs the weight
        return 1e3 * timed(fn, torch.device("cpu"), repeats=30)

    with torch.inference_mode():
        packed(torch.randn(PACK_HINT, 576))  # packs the weight
        for rows in (1, 2, 4, 16):
            x = torch.randn(rows, 576)
            print(f"576 x 49152, {rows:2d} rows: nn.Linear {ms(lambda: lin(x)):6.2f} ms, "
                  f"packed {ms(lambda: packed.forward._packed(x)):6.2f} ms")
        for n_in, n_out in ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)):
            w = torch.randn(n_out, n_in)
            t = kernel_timings(w, 1)
            rows = small_rows(w, None)
            print(f"{n_in} x {n_out}, 1 row: default {t['cached_default']} us, packed {t['cached_packed']} us in the "
                  f"cache; streamed default {t['streamed_default']} us, packed {t['streamed_packed']} us; "
                  f"the default kernel below {rows} rows, packed from {rows}")


if __name__ == "__main__":
    _main()
