"""Packed linear layers for the CPU: `PackedLinear`, swapped in for each `nn.Linear` (`prepack`).

Where it runs (fp32, x86 with AVX2 and FMA, a C++ compiler), a layer's weight is packed for our
few-row kernel (few_rows.py), which reads the weights at memory speed at one row and keeps every
output row bitwise independent of the row count; calls of more than `few_rows.MAX_ROWS` rows run
the default kernel. Elsewhere the weight is packed for oneDNN, as follows.

PyTorch's default fp32 `nn.Linear` on the CPU repacks its weight on every call with more than
one row, so a forward over two tokens cost about what two forwards cost (SmolLM2's LM head:
8.6 ms at one row, 20.4 ms at two). oneDNN can pack a weight once (`_reorder_linear_weight`)
and multiply any number of rows against the packed copy (`_linear_pointwise`, what inductor's
CPU freezing emits): 5.1 ms at one row, 5.0 ms at two, 11.0 ms at sixteen (command:
`python scripts/kernel_cost.py`).

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

`prepack(module)` replaces every `nn.Linear` under `module` by a `PackedLinear` over the same
weight and bias parameters (as torchao's `quantize_` swaps modules): state dicts, tied weights and
optimizers see the same tensors, and the model's source is untouched. Where packing does not apply
(CUDA, fp16, a layer being trained) a packed layer computes as `nn.Linear` does. `use_packed(False)`
(switch.py) runs every layer as `nn.Linear` again, for baselines that must be what transformers
does by itself; `unpack` swaps the plain modules back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import few_rows
from . import precision
from .switch import packed_enabled
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


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies against a packed copy of its weight: few_rows.py's panels
    where that kernel runs, else oneDNN's. The copy is made again when the weight changed since
    (in place, by an optimizer step or a load, or by a move or cast), so a packed layer never
    computes with stale weights. `storage`: the few-row panels' dtype (bf16 or int8: a drafter's
    weights, see `prepack`)."""

    def __init__(self, *args, storage: torch.dtype | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.repack(storage)

    @classmethod
    def of(cls, linear: nn.Linear, storage: torch.dtype | None = None) -> "PackedLinear":
        """A packed layer over `linear`'s own weight and bias parameters (not copies)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.register_parameter("weight", linear.weight)
        new.register_parameter("bias", linear.bias)
        new.training = linear.training
        new.repack(storage)
        return new

    def repack(self, storage: torch.dtype | None) -> None:
        """Pack for `storage` at the next call."""
        self.storage = storage
        self.key = None
        self.packed = None  # oneDNN's packed copy
        self.panels = None  # or few_rows.py's, where that kernel runs (then no oneDNN copy but `many`)
        self.many = None  # a drafter's oneDNN bf16 copy for calls of many rows (MANY_ROWS), made at the first
        self.bf16_many = False  # whether such calls run it: a drafter's panels (`storage`) on a CPU with bf16

    def plain(self) -> nn.Linear:
        """The `nn.Linear` over the same parameters (`unpack`)."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.register_parameter("weight", self.weight)
        linear.register_parameter("bias", self.bias)
        linear.training = self.training
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not packed_enabled() or x.dtype != w.dtype or (
                torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return F.linear(x, w, self.bias)
        # inference tensors have no version counter (and change in place only inside inference mode)
        key = (w.data_ptr(), -1 if w.is_inference() else w._version, w.dtype, w.device)
        if key != self.key:
            self.packed = self.panels = self.many = None
            if few_rows.applies(w):
                self.panels = few_rows.pack(w, self.storage)
                self.bf16_many = self.storage is not None and precision.native_bf16_packing(w.device)
            elif packing_available(w.device, w.dtype):
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT)
            else:
                return F.linear(x, w, self.bias)
            self.key = key
        rows = x.numel() // x.shape[-1]
        if self.panels is not None:
            if rows > MANY_ROWS and self.bf16_many:
                return self._many_rows(x)
            if rows > few_rows.MAX_ROWS:
                return F.linear(x, w, self.bias)
            bias = self.bias
            return few_rows.linear(x, self.panels, w.shape[0], None if bias is None else bias.detach())
        if rows < small_rows(w, self.packed):
            return F.linear(x, w, self.bias)
        return self._packed(x)

    def _many_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A drafter's call of many rows (a batch's blocks, a prompt's context) in oneDNN's bf16
        arithmetic, which outruns the few-row panels there; its numerics cannot change the output."""
        if self.many is None:
            self.many = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().bfloat16(), PACK_HINT)
        return self._onednn(x.bfloat16(), self.many).to(x.dtype)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return self._onednn(x, self.packed)

    def _onednn(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """x [..., K] against a oneDNN-packed copy of the weight in x's dtype -> [..., N]."""
        bias = self.bias
        y = _onednn(x.reshape(-1, x.shape[-1]), packed, None if bias is None else bias.detach().to(x.dtype))
        return y.view(*x.shape[:-1], self.weight.shape[0])  # [..., N]


def small_rows(weight: torch.Tensor, packed: torch.Tensor) -> int:
    """Rows below which the default kernel runs for weights of this shape: measured once per
    process (both kernels at 1..SMALL_ROWS_TRIED rows, median of 3 sweeps each); the default
    kernel keeps a row count only where it is at least 10% faster, and only from one row up.

    Each sweep runs the kernel over enough distinct weights of this shape to overflow the CPU's
    last-level cache (`STREAM_BYTES`), as a forward does: a model's weights (SmolLM2's body is
    424 MB) stream from memory, while one weight called again and again stays in the cache, where
    the default kernel looked faster at one row than it is in a forward (on a 2-core EPYC with a
    32 MB L3, 576 x 576 at one row: 32.7 us in the cache against 49.9 packed, 96.2 streamed
    against 76.4; `python scripts/kernel_cost.py`)."""
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


def prepack(module: nn.Module, storage: torch.dtype | None = None) -> nn.Module:
    """Swap every `nn.Linear` under `module` (itself included) for a `PackedLinear` over the same
    parameters; idempotent (a packed layer keeps its packing, or packs again for another
    `storage`), the packing itself made at each layer's first call. Returns the module: the new
    one where `module` itself was an `nn.Linear`. storage=torch.bfloat16 or torch.int8: where the
    few-row kernel runs, the layers' panels hold their weights rounded to bf16 or quantized to int8
    (computed in fp32; only for a model whose numerics cannot change the output: the drafter).
    Only exact `nn.Linear`s are swapped: a subclass may compute something else."""
    swapped: dict[int, nn.Module] = {}  # a module under two parents is swapped once

    def swap(child: nn.Module) -> nn.Module:
        if isinstance(child, PackedLinear):
            if child.storage != storage:
                child.repack(storage)
            return child
        if type(child) is not nn.Linear or _hooked(child):  # a hook on it would be lost with it
            return child
        if id(child) not in swapped:
            swapped[id(child)] = PackedLinear.of(child, storage)
        return swapped[id(child)]

    _replace(module, swap)
    return swap(module)


def unpack(module: nn.Module) -> nn.Module:
    """Undo `prepack`: plain `nn.Linear`s over the same parameters (the module, or its plain self)."""
    plain_of: dict[int, nn.Module] = {}  # a module under two parents comes back as one

    def plain(child: nn.Module) -> nn.Module:
        if not isinstance(child, PackedLinear):
            return child
        return plain_of.setdefault(id(child), child.plain())

    _replace(module, plain)
    return plain(module)


def _replace(module: nn.Module, swap) -> None:
    """Each child of each module under `module` replaced by `swap(child)` in its parent."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            new = swap(child)
            if new is not child:
                setattr(parent, name, new)


def _hooked(module: nn.Module) -> bool:
    """Whether hooks were registered on the module (transformers' output recorders, a user's)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def is_packed(layer: nn.Module) -> bool:
    return isinstance(layer, PackedLinear)
