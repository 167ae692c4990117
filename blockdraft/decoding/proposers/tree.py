"""The drafter's tree: the same forward as a chain's, several candidates per block position and
the lookup continuation as one more branch, its size chosen from the measured cost of verifying
n tokens (decoding/tree.py builds it)."""

from __future__ import annotations

import itertools

import torch

from ...models.vocab import Ranked
from ..gumbel import Chooser
from ..tree import WIDTH, build_tree, draft_candidates, plan_trees, truncate
from ..verify import probs_from_logits
from .proposal import Proposal
from .request import Proposers


def budget(p: Proposers, depth: int, lookup: list[int], cap: int | None = None) -> tuple[int, int]:
    """This step's node budget (fixed, or the policy's best for the expected value of each n,
    or a batch's choice `cap`) and the block positions the drafter must propose for it (at
    most `depth`). Where the size is chosen again after the draft (`resizes`), the drafter
    proposes as deep as the largest tree reaches: a draft forward grows slowly with its block
    (far less than the verify forward with its tokens), and a sure drafter's tree goes deeper
    than the average plan's."""
    plan = plan_trees(p.rates, depth, p.tree_budget, WIDTH, len(lookup))
    if p.tree is None:
        size = p.tree_budget
    elif cap is not None:
        size = min(cap, p.tree_budget)
    else:
        p.tree.plan(plan.expected)
        size = p.tree.choose()
        if size > 1 and p.resizes:
            return size, plan.drafter_depth[-1]
    return size, plan.drafter_depth[size - 1]


def propose(p: Proposers, drafted: Ranked | torch.Tensor, anchor: int, size: int, lookup: list[int], gen,
            resize: bool = False, choose: Chooser | None = None, position: int = 0) -> Proposal:
    """A tree of `size` nodes (and a lookup branch) from the drafter's best token ids and their
    probabilities [D, WIDTH] (greedy proposals), shaped by its confidence in each, or from its
    logits [D, V] (sampled proposals). `resize` (a lone sequence's adaptive size, `resizes`):
    the size is chosen again from this draft's own tree, whose expected tokens its confidence
    tells (the plan before the draft knew only the average tree's, by ranks). Coupled: the
    candidates are the best perturbed scores of each position (its logits [D, V], the noise of
    positions position + 1 .. + D), with the drafter's probability of each, as greedy ones."""
    if p.coupled:
        drafted = Ranked(*choose.best(drafted, list(range(position + 1, position + 1 + drafted.shape[0])), WIDTH))
    if p.greedy_proposals:
        resize = resize and p.resizes
        tree = build_tree(drafted.ids.tolist(), anchor, p.tree_budget if resize else size, p.rates, lookup,
                          confidence=drafted.probs.tolist())
        if resize:
            tree = truncate(tree, p.tree.best_size(list(itertools.accumulate(tree.values)), size))
    else:
        q = probs_from_logits(drafted, p.sampling)  # [D, V]
        cands = draft_candidates(q, WIDTH, True, gen)
        tree = build_tree(cands, anchor, size, p.rates, lookup, merge=False, q=q)
    return Proposal(tree, "tree", p.tree, ran_draft=True)
