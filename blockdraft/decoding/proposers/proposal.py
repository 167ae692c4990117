"""What a step verifies after its anchor (`Proposal`), and what waits for the drafter's forward
(`DraftWanted`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..adaptive import AdaptiveBlockPolicy
from ..tree import Tree


@dataclass
class Proposal:
    """What a step verifies after its anchor: a draft (tree.py's `Tree`: a chain's parents are
    i - 1, a plain step's draft is the anchor alone), who proposed it, and the policy whose choice
    it was (it learns the step's cost)."""

    draft: Tree
    kind: str = "plain"  # plain, lookup (no draft forward), chain or tree (the drafter's)
    policy: AdaptiveBlockPolicy | None = None
    ran_draft: bool = False  # a draft forward ran: the pending draft context went in

    @property
    def block(self) -> int:
        """Tokens the target verifies, the anchor included."""
        return len(self.draft)

    @property
    def looked_up(self) -> bool:
        return self.kind == "lookup"


@dataclass
class DraftWanted:
    """A sequence whose proposal waits for the drafter's logits of a block: the drafter runs once
    for every sequence of a step that drafts (`draft_blocks`)."""

    seq: object  # engine.Sequence
    block: int
    finish: Callable[[torch.Tensor], Proposal]  # the proposal from the drafter's output for the block
    top: int = 0  # that output: the ids of its `top` best tokens per position [block - 1, top] (0: its logits [block - 1, V])
    ranked: bool = False  # ... with the drafter's probability of each (`Ranked`; a greedy tree's candidates)
