"""Prompt lookup: the continuation of an earlier occurrence of the context's last n-gram
(decoding/lookup.py finds it), proposed with no forward at all where its own adaptive policy
expects it to pay, or as one more branch of the drafter's tree."""

from __future__ import annotations

from ..lookup import lookup_proposals
from ..tree import Tree
from .proposal import Proposal
from .request import Proposers


def propose(p: Proposers, history: list[int], room: int, batched: bool = False) -> Proposal | None:
    """Prompt-lookup tokens where they are expected to pay, else None. `batched`: the step is
    one of several sequences whose block the batch chose (`room`); the lookup's tokens are
    free there (no draft forward), so they go instead of the drafter's where they are expected
    to yield as many tokens."""
    found = lookup_proposals(history, min(p.lookup_block, room) - 1) if p.lookup_block > 1 else None
    if not found:
        return None
    policy = None
    if p.lookup_adaptive:
        policy = p.policies.lookup(found.ngram, p.lookup_block)
    if batched:
        tokens = found.tokens
        if policy is not None and p.chain is not None and \
                policy.expected_tokens(1 + len(tokens)) < p.own.expected_tokens(room):
            return None
        return Proposal(Tree.chain(history[-1], tokens), "lookup", policy)
    tokens = found.tokens[: policy.choose() - 1] if policy else found.tokens
    drafter = p.chain if p.chain is not None else p.tree
    if tokens and policy is not None and drafter is not None:
        # the alternative is the drafter's block or tree, not a plain step: verify the lookup
        # only if it is expected to yield as many tokens per second (while either is
        # unmeasured, try it)
        mine, theirs = policy.rate(1 + len(tokens)), drafter.best_rate()
        if mine is not None and theirs is not None and (mine < theirs or drafter.count_idle_step()):
            return None  # the drafter's turn (now and then as a probe, though the lookup looks better)
    if not tokens:  # its policy expects no lookup token to pay: the drafter's turn
        return None
    return Proposal(Tree.chain(history[-1], tokens), "lookup", policy)  # history[-1]: the anchor


def branch(p: Proposers, history: list[int], room: int) -> list[int]:
    """A tree's lookup branch: the continuation as found (the tree's rates judge it)."""
    if p.lookup_block <= 1:
        return []
    found = lookup_proposals(history, min(p.lookup_block, room) - 1)
    return found.tokens if found else []
