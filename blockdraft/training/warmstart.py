"""How a drafter's weights enter and leave training: a warm start from the target's own layers
or from a saved drafter (widened when the run taps more layers), and the export that folds the
tap-channel scale back into `fc`."""

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
    base = target.reference_model().base_model  # transformers' own layers (not blocks, not fused)
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
    # the block size is no weight: a drafter may continue at another block (the block study does),
    # and with more taps than it has, if its taps are among them (the more-taps study does)
    columns = tap_columns(a.target_layer_ids, b.target_layer_ids)
    if len(src.layers) != len(draft.layers) or columns is None:
        raise BlockdraftError(f"--init {path}: its drafter has {len(src.layers)} layers, taps {a.target_layer_ids}; "
                              f"this run wants {len(draft.layers)}, {b.target_layer_ids} (taps may only be added)")
    if a.conditioning != b.conditioning:
        raise BlockdraftError(f"--init {path}: its conditioning is {a.conditioning!r}, this run's {b.conditioning!r}")
    state = {k: v.float() for k, v in src.state_dict().items()}
    h = b.hidden_size
    old = state["fc.weight"]  # [H, K_old * H]: one block of columns per tap, in the taps' order
    wide = old.new_zeros(h, len(b.target_layer_ids) * h)  # a new tap's columns start at zero: the
    for j, i in enumerate(columns):                       # widened drafter predicts exactly as before
        wide[:, i * h:(i + 1) * h] = old[:, j * h:(j + 1) * h]
    state["fc.weight"] = wide
    draft.load_state_dict(state)
    if tap_scale is not None:  # exported fc(taps) == W taps; ours sees taps / s, so W * s
        draft.fc.weight.data *= tap_scale.to(draft.fc.weight)[None, :]


def tap_columns(old: list[int], new: list[int]) -> list[int] | None:
    """Where each of a drafter's taps sits among a run's taps (its fc column block there), each
    place used once (a small target repeats a layer); None if some tap of `old` is not in `new`."""
    free = list(range(len(new)))
    places = []
    for layer in old:
        i = next((i for i in free if new[i] == layer), None)
        if i is None:
            return None
        free.remove(i)
        places.append(i)
    return places


def exportable(draft: DraftModel, tap_scale: torch.Tensor | None) -> DraftModel:
    """A copy with the tap scale folded into fc: fc(taps / s) == (W / s) taps."""
    out = copy.deepcopy(draft).eval()
    if tap_scale is not None:
        out.fc.weight.data /= tap_scale.to(out.fc.weight)[None, :]
    return out
