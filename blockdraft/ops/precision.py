"""Which dtype the drafter computes and stores its weights in, on this device: its numerics
cannot change the output (verification is exact), so the cheapest the hardware runs is free."""

from __future__ import annotations

import torch

from . import few_rows
from .cpu import cpu_flags

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
