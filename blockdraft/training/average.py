"""Average the weights of drafters of one lineage (a "model soup") into a new drafter
(`blockdraft average OUT DRAFTER DRAFTER ... [--weights W ...] [--dtype float16]`).

Drafters continued from one another (stage 6 -> stage 7 of the bundled drafter) sit in one basin
of the loss, so a weighted mean of their weights is itself a drafter; it can keep most of what a
later stage learnt on one kind of text while giving back less of what it forgot on another.
All drafters must have the same config.json (shapes, taps, block size); weights default to
equal and are normalised to sum to 1. The embedding and LM head are not in a drafter's
checkpoint (they are the target's), so only the draft's own tensors are averaged.
"""

from __future__ import annotations

import torch

from ..errors import BlockdraftError
from ..models.checkpoint import config_to_json, load_draft


def average(paths: list[str], weights: list[float] | None = None):
    """The weighted mean of the drafters in `paths` (fp32), as a DraftModel."""
    if len(paths) < 2:
        raise BlockdraftError("give at least two drafters to average")
    weights = weights or [1.0] * len(paths)
    if len(weights) != len(paths):
        raise BlockdraftError(f"{len(weights)} weights for {len(paths)} drafters")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise BlockdraftError(f"weights must be >= 0 with a positive sum, not {weights}")
    models = [load_draft(p, dtype=torch.float32) for p in paths]
    config = config_to_json(models[0].cfg)
    for p, m in zip(paths[1:], models[1:]):
        if config_to_json(m.cfg) != config:
            raise BlockdraftError(f"{p}: config.json differs from {paths[0]}'s; only one lineage averages")
    total = sum(weights)
    states = [m.state_dict() for m in models]
    mean = {k: sum(w / total * s[k] for w, s in zip(weights, states)) for k in states[0]}
    models[0].load_state_dict(mean)
    return models[0]
