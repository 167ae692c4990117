"""How a drafter's weights enter and leave training: a warm start from the target's own layers
or from a saved drafter, and the export that folds the tap-channel scale back into `fc`."""

from __future__ import annotations

import copy

import torch

from .draft import DraftModel
from .errors import BlockdraftError


def init_from_target(draft: DraftModel, target) -> None:
    """Copy the target's last n decoder layers (and final norm) into the draft layers: they
    already turn deep hidden states into next-token predictions. q_norm/k_norm stay at 1."""
    layers = target.model.model.layers
    src = layers[len(layers) - len(draft.layers):]
    for dst, s in zip(draft.layers, src):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(dst.self_attn, name).weight.data.copy_(getattr(s.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(dst.mlp, name).weight.data.copy_(getattr(s.mlp, name).weight)
        dst.input_layernorm.weight.data.copy_(s.input_layernorm.weight)
        dst.post_attention_layernorm.weight.data.copy_(s.post_attention_layernorm.weight)
    draft.norm.weight.data.copy_(target.model.model.norm.weight)


def init_from_drafter(draft: DraftModel, path: str, tap_scale: torch.Tensor | None) -> None:
    """Start from a saved drafter: its weights, with its folded tap scale unfolded again for ours."""
    from .checkpoint import load_draft

    src = load_draft(path)
    a, b = src.cfg, draft.cfg
    if (len(src.layers), a.block_size, a.target_layer_ids) != (len(draft.layers), b.block_size, b.target_layer_ids):
        raise BlockdraftError(f"--init {path}: its drafter has {len(src.layers)} layers, block {a.block_size}, taps "
                              f"{a.target_layer_ids}; this run wants {len(draft.layers)}, {b.block_size}, "
                              f"{b.target_layer_ids}")
    draft.load_state_dict({k: v.float() for k, v in src.state_dict().items()})
    if tap_scale is not None:  # exported fc(taps) == W taps; ours sees taps / s, so W * s
        draft.fc.weight.data *= tap_scale.to(draft.fc.weight)[None, :]


def exportable(draft: DraftModel, tap_scale: torch.Tensor | None) -> DraftModel:
    """A copy with the tap scale folded into fc: fc(taps / s) == (W / s) taps."""
    out = copy.deepcopy(draft).eval()
    if tap_scale is not None:
        out.fc.weight.data /= tap_scale.to(out.fc.weight)[None, :]
    return out
