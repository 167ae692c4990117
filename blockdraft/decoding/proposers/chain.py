"""The drafter's chain: one block-diffusion forward, one token per block position (the
drafter's best, its perturbed best under the Gumbel coupling, or a draw from q)."""

from __future__ import annotations

import torch

from ..gumbel import Chooser
from ..tree import Tree
from ..verify import probs_from_logits, sample
from .proposal import Proposal
from .request import Proposers


def block(p: Proposers, room: int) -> int:
    return min(p.chain.choose() if p.chain is not None else p.block_size, room)


def propose(p: Proposers, drafted: torch.Tensor, anchor: int, gen, choose: Chooser | None = None,
            position: int = 0) -> Proposal:
    """The chain after `anchor` of n drafts: with greedy proposals the drafter's best token ids
    [n, 1]; coupled, the argmax of its logits [n, V] perturbed by the noise of positions
    position + 1 .. + n; else drawn from its logits, with the q [n, V] they were drawn from."""
    q = None
    if p.coupled:
        drafts = choose.pick(drafted, list(range(position + 1, position + 1 + drafted.shape[0])))
    elif p.greedy_proposals:
        drafts = drafted[:, 0]
    else:
        q = probs_from_logits(drafted, p.sampling)
        drafts = sample(q, gen)
    return Proposal(Tree.chain(anchor, drafts.tolist(), q), "chain", p.chain, ran_draft=True)
