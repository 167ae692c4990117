"""How a drafter's weights enter and leave training: a warm start from the target's own layers
or from a saved drafter, and the export that folds the tap-channel scale back into `fc`."""

from __future__ import annotations

import copy

import torch

from ..models.draft import DraftModel
from ..errors import BlockdraftError


def init_from_target(draft: DraftModel, target) -> list[str]:
    """Copy the target's last n decoder layers (and final norm) into the draft layers: they
    already turn deep hidden states into next-token predictions. q_norm/k_norm stay at 1. Only
    weights with a counterpart of the same shape are copied (a MoE block, an MLA or linear-attention
    mixer has none, and stays as initialised); returns the names copied."""
    base = target.model.base_model
    layers = base.layers
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    pairs = [(f"layers.{i}.{n}", dst.get_submodule(n), src, n) for i, (dst, src) in
             enumerate(zip(draft.layers, layers[len(layers) - len(draft.layers):])) for n in names]
    pairs.append(("norm", draft.norm, base, "norm"))
    copied = []
    for label, dst, src, name in pairs:
        try:
            weight = src.get_submodule(name).weight
        except AttributeError:
            continue
        if weight.shape == dst.weight.shape:
            dst.weight.data.copy_(weight)
            copied.append(label)
    return copied


def init_from_drafter(draft: DraftModel, path: str, tap_scale: torch.Tensor | None) -> None:
    """Start from a saved drafter: its weights, with its folded tap scale unfolded again for ours."""
    from ..models.checkpoint import load_draft

    src = load_draft(path)
    a, b = src.cfg, draft.cfg
    if not a.plain_attention:
        raise BlockdraftError(f"--init {path}: its layers are causal or sliding-window ({a.layer_types}); "
                              "the trainer trains full bidirectional draft layers only")
    # the block size is no weight: a drafter may continue at another block (the block study does)
    if (len(src.layers), a.target_layer_ids) != (len(draft.layers), b.target_layer_ids):
        raise BlockdraftError(f"--init {path}: its drafter has {len(src.layers)} layers, taps {a.target_layer_ids}; "
                              f"this run wants {len(draft.layers)}, {b.target_layer_ids}")
    if a.conditioning != b.conditioning:
        raise BlockdraftError(f"--init {path}: its conditioning is {a.conditioning!r}, this run's {b.conditioning!r}")
    draft.load_state_dict({k: v.float() for k, v in src.state_dict().items()})
    if tap_scale is not None:  # exported fc(taps) == W taps; ours sees taps / s, so W * s
        draft.fc.weight.data *= tap_scale.to(draft.fc.weight)[None, :]


def exportable(draft: DraftModel, tap_scale: torch.Tensor | None) -> DraftModel:
    """A copy with the tap scale folded into fc: fc(taps / s) == (W / s) taps."""
    out = copy.deepcopy(draft).eval()
    if tap_scale is not None:
        out.fc.weight.data /= tap_scale.to(out.fc.weight)[None, :]
    return out
