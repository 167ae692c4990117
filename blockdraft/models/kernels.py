"""Prepacked linear layers for the CPU: the one kernel change the fast forward makes.

PyTorch's default fp32 `nn.Linear` on the CPU repacks its weight on every call with more than
one row, so a forward over two tokens cost about what two forwards cost (SmolLM2's LM head:
8.6 ms at one row, 20.4 ms at two). oneDNN can pack a weight once (`_reorder_linear_weight`)
and multiply any number of rows against the packed copy (`_linear_pointwise`, what inductor's
CPU freezing emits): 5.1 ms at one row, 5.0 ms at two, 11.0 ms at sixteen (command:
`python -m blockdraft.models.kernels`).

It also makes each output row bitwise independent of how many rows are multiplied with it,
which the default kernel is not (one row and three rows round differently). A speculative
verify over 16 tokens then computes every linear layer exactly as 16 one-token forwards would.

`prepack(module)` swaps the forward of every `nn.Linear` under `module` for the packed one,
in place, without touching the model's source. Where packing does not apply (CUDA, fp16, a
layer being trained) the layer runs as it always did. `use_packed(False)` (a context manager)
runs the original layers again, for baselines that must be what transformers does by itself.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

_STATE = threading.local()
PACK_HINT = 16  # rows the packing is laid out for; rows stay bitwise consistent at every count (tested)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:  # oneDNN packs bf16 only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


@contextlib.contextmanager
def use_packed(enabled: bool):
    """Within the block, prepacked layers run packed (True) or as the plain `nn.Linear` (False)."""
    before = _STATE.__dict__.get("enabled", True)
    _STATE.enabled = enabled
    try:
        yield
    finally:
        _STATE.enabled = before


class _PackedForward:
    """The forward of one `nn.Linear`, against a oneDNN-packed copy of its weight. The copy is
    made again when the weight changed since (in place, by an optimizer step or a load, or by a
    move or cast), so a packed layer never computes with stale weights."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear
        self.original = linear.forward
        self.key = None
        self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        if not _STATE.__dict__.get("enabled", True) or x.dtype != w.dtype or (
                torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return self.original(x)
        # inference tensors have no version counter (and change in place only inside inference mode)
        key = (w.data_ptr(), -1 if w.is_inference() else w._version, w.dtype, w.device)
        if key != self.key:
            if not packing_available(w.device, w.dtype):
                return self.original(x)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT)
            self.key = key
        bias = self.linear.bias
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed,
                                               None if bias is None else bias.detach(), "none", [], "")
        return y.view(*x.shape[:-1], w.shape[0])  # [..., N]


def prepack(module: nn.Module) -> int:
    """Give every `nn.Linear` under `module` the packed forward (idempotent; the packing itself
    happens at each layer's first call); returns how many layers now have it."""
    count = 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            if not is_packed(layer):
                layer.forward = _PackedForward(layer)
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


def fast_draft_dtype(device: torch.device, target_dtype: torch.dtype) -> torch.dtype:
    """The drafter's dtype for `--draft-dtype auto`: bf16 on CUDA and on a CPU with native bf16
    instructions (AVX512-BF16 or AMX) that oneDNN packs for; else the target's dtype (without
    them bf16 is emulated and slower: on an AVX2-only CPU the bundled drafter's block-16 forward
    took 81 ms in bf16 against 19 ms in fp32)."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and native_cpu_bf16() and torch.backends.mkldnn.is_available() \
            and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return target_dtype


def native_cpu_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (Linux: read from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
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
        for rows in (1, 2, 4, 16):
            x = torch.randn(rows, 576)
            print(f"576 x 49152, {rows:2d} rows: nn.Linear {ms(lambda: lin(x)):6.2f} ms, "
                  f"packed {ms(lambda: packed(x)):6.2f} ms")


if __name__ == "__main__":
    _main()
