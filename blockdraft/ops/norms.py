"""Fused RMSNorm forwards on the CPU: one pass over each row (`few_rows.rms_norm`) in place of the
eight or so PyTorch ops a model's RMSNorm module runs.

At a decode step's few rows those ops cost their dispatch, not their arithmetic, and SmolLM2's
forward runs 61 norms (the bundled drafter 20): fused, its one-token forward took 31.2 ms against
35.7 (`python scripts/forward_cost.py --norms`, 2-core EPYC). `fuse_norms(model)` replaces each
norm module whose output the fused kernel reproduces by a `FusedRMSNorm` over the same weight
parameter (a module swap: the model's source and state dict unchanged): a module is fused only if
its class is named like an RMSNorm, its state is a 1-D weight alone, it has an epsilon, and on a
probe input its own forward and the kernel agree to rounding (a norm of `1 + weight`, as Gemma's,
or one with a gate, fails the probe and is kept). Each row is normalised alone, so a block's rows
compute exactly what one-token rows do, as the few-row linear kernel's.

Where the kernel does not run (CUDA, 16-bit types, no kernel, a layer being trained) and within
`switch.use_packed(False)` the replaced module computes, as it always did.
"""

from __future__ import annotations

import torch
from torch import nn

from . import few_rows
from .switch import packed_enabled

PROBE_TOLERANCE = 1e-5  # relative: rounding (the kernel sums squares in another order than torch's mean)


class FusedRMSNorm(nn.Module):
    """An RMSNorm by the fused kernel, swapped in by `fuse_norms` for the module it replaces (kept,
    outside the module tree, for the calls the kernel does not take: `replaced`)."""

    def __init__(self, norm: nn.Module, eps: float):
        super().__init__()
        self.register_parameter("weight", norm.weight)  # the same parameter: the state dict is the norm's
        self.eps = eps
        self._replaced = (norm,)  # a tuple: not a submodule, so its weight is not listed twice

    @property
    def replaced(self) -> nn.Module:
        """The replaced norm, over this module's weight parameter (put back if a load with
        `assign=True` or a conversion replaced the parameter here)."""
        norm = self._replaced[0]
        if norm.weight is not self.weight:
            norm.weight = self.weight
        return norm

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not runs_fused(self, x):  # more than the rows (a gate): as written
            return self.replaced(x, *args, **kwargs)
        return few_rows.rms_norm(x, self.weight.detach(), self.eps)


def is_fused(norm: nn.Module) -> bool:
    """Whether `fuse_norms` swapped this module in (and `unfuse_norms` has not swapped it out)."""
    return isinstance(norm, FusedRMSNorm)


def runs_fused(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether `norm`, given `x`, runs the fused kernel: it was fused (`fuse_norms`), and this call is
    fp32 on the CPU, not being trained, outside `use_packed(False)`."""
    w = norm.weight
    return is_fused(norm) and packed_enabled() and x.dtype == torch.float32 \
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


def _fusable(module: nn.Module) -> float | None:
    """The epsilon of a norm the kernel reproduces, else None: named like an RMSNorm, its state a
    1-D weight alone, no hooks on it (they would be lost with it), on a CPU in fp32, and its
    forward and the kernel agreeing on a probe."""
    w = getattr(module, "weight", None)
    eps = _epsilon(module)
    if "rmsnorm" not in type(module).__name__.lower() or not isinstance(w, nn.Parameter) or w.dim() != 1 \
            or eps is None or list(module.state_dict()) != ["weight"] or any(True for _ in module.buffers()) \
            or module._forward_hooks or module._forward_pre_hooks:
        return None
    return eps if few_rows.runs_on(w.device, w.dtype) and _reproduces(module, eps) else None


def fuse_norms(model: nn.Module) -> int:
    """Swap a `FusedRMSNorm` in for every RMSNorm under `model` that the kernel reproduces
    (idempotent); returns how many are fused. Does nothing where the kernel cannot run (not fp32
    on this CPU)."""
    count = 0
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            if is_fused(module):
                count += 1
            elif (eps := _fusable(module)) is not None:
                setattr(parent, name, FusedRMSNorm(module, eps))
                count += 1
    return count


def unfuse_norms(model: nn.Module) -> None:
    """Undo `fuse_norms`: the replaced modules back in their places."""
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            if is_fused(module):
                setattr(parent, name, module.replaced)
