"""Fused RMSNorm forwards on the CPU: one pass over each row (`few_rows.rms_norm`) in place of the
eight or so PyTorch ops a model's RMSNorm module runs.

At a decode step's few rows those ops cost their dispatch, not their arithmetic, and SmolLM2's
forward runs 61 norms (the bundled drafter 20): fused, its one-token forward took 31.2 ms against
35.7 (`python scripts/forward_cost.py --norms`, 2-core EPYC). `fuse_norms(model)` swaps the forward of each norm module
whose output the fused kernel reproduces, in place, without touching the model's source: a
module is fused only if its class is named like an RMSNorm, it holds a 1-D weight and an epsilon,
and on a probe input its own forward and the kernel agree to rounding (a norm of `1 + weight`,
as Gemma's, or one with a gate, fails the probe and keeps its forward). Each row is normalised
alone, so a block's rows compute exactly what one-token rows do, as the few-row linear kernel's.

Where the kernel does not run (CUDA, 16-bit types, no kernel, a layer being trained) and within
`kernels.use_packed(False)` the module runs its own forward.
"""

from __future__ import annotations

import torch
from torch import nn

from . import few_rows
from .kernels import _packed_enabled

PROBE_TOLERANCE = 1e-5  # relative: rounding (the kernel sums squares in another order than torch's mean)


class _FusedNorm:
    def __init__(self, module: nn.Module, eps: float):
        self.module, self.eps = module, eps
        self.original = module.forward

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not runs_fused(self.module, x):  # more than the rows (a gate): as written
            return self.original(x, *args, **kwargs)
        return few_rows.rms_norm(x, self.module.weight.detach(), self.eps)


def is_fused(norm: nn.Module) -> bool:
    """Whether `fuse_norms` gave this module the fused forward (and `unfuse_norms` has not taken it)."""
    return isinstance(norm.__dict__.get("forward"), _FusedNorm)


def runs_fused(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether `norm`, given `x`, runs the fused kernel: it was fused (`fuse_norms`), and this call is
    fp32 on the CPU, not being trained, outside `use_packed(False)`."""
    w = norm.weight
    return is_fused(norm) and _packed_enabled() and x.dtype == torch.float32 \
        and w.dtype == torch.float32 and x.device.type == "cpu" \
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


def _reproduces(module: nn.Module, eps: float) -> bool:
    """Whether the fused kernel gives this module's output on a probe input (3 rows of its width)."""
    w = module.weight
    x = torch.randn(3, w.shape[0], generator=torch.Generator().manual_seed(0)) * 3
    try:
        with torch.no_grad():
            mine, theirs = few_rows.rms_norm(x, w.detach(), eps), module.forward(x)
    except Exception:  # a norm with other arguments (a gate) or shapes
        return False
    return isinstance(theirs, torch.Tensor) and theirs.shape == mine.shape and theirs.dtype == torch.float32 \
        and bool(torch.allclose(mine, theirs, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE))


def fuse_norms(model: nn.Module) -> int:
    """Give every RMSNorm under `model` that the kernel reproduces the fused forward (idempotent);
    returns how many have it. Does nothing where the kernel cannot run (not fp32 on this CPU)."""
    count = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _FusedNorm):
            count += 1
            continue
        w = getattr(module, "weight", None)
        eps = _epsilon(module)
        if "rmsnorm" not in type(module).__name__.lower() or not isinstance(w, torch.Tensor) or w.dim() != 1 \
                or eps is None or not few_rows.runs_on(w.device, w.dtype) or not _reproduces(module, eps):
            continue
        module.forward = _FusedNorm(module, eps)
        count += 1
    return count


def unfuse_norms(model: nn.Module) -> None:
    """Undo `fuse_norms`."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _FusedNorm):
            del module.forward
