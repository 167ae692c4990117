"""Token trees from one draft forward, verified by one target forward: pure tensor code.

A block-diffusion drafter predicts every block position in one forward, each with a whole
distribution; a chain verifies only one token of each. A tree spends the same verify budget where
acceptance is likeliest: the root is the anchor, a node at depth d holds a candidate for block
position d, and the tree is grown greedily by each node's expected value, the product of the
acceptance rates along its path. The rates, by (depth, rank), are learned online from the
verdicts (`TreeRates`). Where the drafter's probability of each candidate is known (greedy
proposals, `vocab.Ranked`), the rate of a node is the one learned for its depth and that
probability's bin instead: the drafter's confidence, calibrated by the verdicts, shapes each
step's tree (deep where it is sure, wide where it is not), as EAGLE-2 shapes its trees by the
draft's scores. A chain is the tree of rank 0 everywhere (`Tree.chain`), a plain step the root alone. Prompt-lookup continuations
enter the same tree as one more branch (rank `LOOKUP`), so a step never has to choose between
lookup and drafter.

Candidates at depth d: the drafter's top tokens of position d (greedy, or argmax proposals at
T > 0), or tokens drawn from its distribution q_d without replacement (sampled proposals); rank r
is the r-th of them. Because the drafter predicts position d once for the whole block, every node
at depth d - 1 offers the same candidates as children.

Verdicts (verify.py: `verify_tree_greedy`, `verify_tree_sampled`), at the nodes of the walk from the root:
- T = 0: step to the child holding the target's argmax; the argmax after the last node is the bonus.
- T > 0 (SpecInfer's multi-candidate rejection sampling, here without replacement as in recursive
  rejection sampling): try the children in order, the lookup child first (a deterministic proposal,
  q one-hot), then the drafter's by rank. A child with token x drawn from q' (q_d without the
  tokens drawn before it, renormalised; one-hot for deterministic candidates) is accepted with
  probability min(1, p(x) / q'(x)); on rejection p becomes normalize(max(0, p - q')). When no child
  is accepted the token is drawn from what is left of p (the recovered token), at a leaf from p
  itself (the bonus). Each stage is Leviathan et al.'s rule for its own proposal, so the committed
  token at every node is distributed exactly as the target's p there, whatever q is.
The cache then keeps exactly the accepted path (`Target.keep_path`).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..models.vocab import top_ids

LOOKUP = -1  # the rank of a prompt-lookup node
WIDTH = 4  # drafter candidates per block position
# bins of the drafter's probability of a candidate (`TreeRates.rate`'s confidence): fine at both
# ends, where the top candidate's sure positions and the runners-up's long shots fall
CONFIDENCE_EDGES = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
CONFIDENCE_DEPTHS = 6  # depths 6 and deeper share their bins


@dataclass
class Tree:
    tokens: list[int]  # node i's token; node 0 is the root (the anchor)
    parents: list[int]  # node i's parent (-1 for the root); a parent always precedes its children
    depths: list[int]  # 0 for the root; a node at depth d proposes block position d
    ranks: list[int]  # its candidate's rank at position d (0 = the drafter's first; LOOKUP; root 0)
    values: list[float] = field(default_factory=list)  # expected value: P(node accepted), root 1
    candidates: list[list[int]] = field(default_factory=list)  # [depth - 1][rank]: all drafter candidates
    confidence: list[list[float]] | None = None  # [depth - 1][rank]: the drafter's probability of each (None: unknown)
    q: torch.Tensor | None = None  # [D, V] the distributions sampled candidates were drawn from (None: deterministic)

    @classmethod
    def chain(cls, anchor: int, drafts: list[int], q: torch.Tensor | None = None) -> "Tree":
        """The chain [anchor, drafts]: node i's parent is i - 1, at depth i, rank 0 (a plain step:
        the anchor alone). `q`: the [n, V] distributions sampled drafts were drawn from."""
        n = len(drafts)
        return cls([anchor, *drafts], list(range(-1, n)), list(range(n + 1)), [0] * (n + 1), q=q)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Every node the child of the one before: a chain, verified and cached without a mask."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def attention_mask(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j iff j is i or one of its ancestors."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, i] = True
            if self.parents[i] >= 0:
                mask[i] |= mask[self.parents[i]]
        return mask

    def children(self, node: int) -> list[int]:
        """Node's children in verification order: the lookup child first, then by rank."""
        kids = [i for i, p in enumerate(self.parents) if p == node]
        return sorted(kids, key=lambda i: self.ranks[i])

    def expected_tokens(self) -> float:
        """Expected tokens a step with this tree commits: accepted nodes + the bonus/recovered one."""
        return sum(self.values)

    def shape(self) -> list[int]:
        """Nodes per depth (depth 0, the root, first): what a bench reports of the trees used."""
        counts = [0] * (max(self.depths) + 1)
        for d in self.depths:
            counts[d] += 1
        return counts


@dataclass
class TreeRates:
    """P(a node is accepted | its parent was) by (depth, rank), counted from verdicts, with a prior
    that halves with each rank (so an unmeasured tree starts close to a chain; lookup: 0.5).
    Counts are halved past `memory` tries, so that the rates keep adapting."""

    accepted: dict = field(default_factory=dict)
    tried: dict = field(default_factory=dict)
    prior_weight: float = 2.0
    memory: int = 2000
    by_confidence: bool = True  # False: ranks alone, as before confidence (scripts/tree_tau.py compares)

    def rate(self, depth: int, rank: int, confidence: float | None = None) -> float:
        """P(accepted | parent accepted) of the rank-th candidate at this depth; given the drafter's
        probability of the candidate, the rate of its (depth, confidence bin), whose prior is the
        (depth, rank) rate: a bin not yet measured ranks as before, a measured one by its verdicts."""
        prior = 0.5 if rank == LOOKUP else 0.5 ** (rank + 1)
        key = (depth, rank)
        by_rank = (self.accepted.get(key, 0) + self.prior_weight * prior) / (self.tried.get(key, 0) + self.prior_weight)
        if confidence is None or rank == LOOKUP or not self.by_confidence:
            return by_rank
        key = confidence_key(depth, confidence)
        return (self.accepted.get(key, 0) + self.prior_weight * by_rank) / (self.tried.get(key, 0) + self.prior_weight)

    def update(self, tree: Tree, path: list[int]) -> None:
        for i, accepted in tried_nodes(tree, path):
            d, r = tree.depths[i], tree.ranks[i]
            self._count((d, r), accepted)
            if tree.confidence is not None and r != LOOKUP:
                self._count(confidence_key(d, tree.confidence[d - 1][r]), accepted)

    def _count(self, key: tuple, accepted: bool) -> None:
        self.tried[key] = self.tried.get(key, 0) + 1
        self.accepted[key] = self.accepted.get(key, 0) + accepted
        if self.tried[key] > self.memory:
            self.tried[key] //= 2
            self.accepted[key] /= 2


def tried_nodes(tree: Tree, path: list[int]) -> Iterator[tuple[int, bool]]:
    """(node, accepted) of each node a verdict tried: every child of an accepted node was tried;
    the one on the path was accepted."""
    on_path = set(path)
    for i in range(1, len(tree)):
        if tree.parents[i] in on_path:
            yield i, i in on_path


def confidence_key(depth: int, confidence: float) -> tuple[str, int, int]:
    return ("confidence", min(depth, CONFIDENCE_DEPTHS), bisect.bisect(CONFIDENCE_EDGES, confidence))


def build_tree(candidates: list[list[int]], anchor: int, budget: int, rates: TreeRates,
               lookup: list[int] = (), merge: bool = True, q: torch.Tensor | None = None,
               confidence: list[list[float]] | None = None) -> Tree:
    """A tree of at most `budget` nodes (the root included). `candidates[d - 1]`: the drafter's
    tokens for position d, best first (`confidence[d - 1]`: its probability of each, if known);
    `lookup`: a prompt-lookup continuation, a chain from the root. Nodes are added in order of
    expected value, so the first n nodes are the best tree of n (`truncate`). `merge`: a candidate
    equal to a sibling's token reuses that node (its own children continue under it); right when
    every candidate is deterministic (T = 0, argmax proposals), not for sampled ones, whose every
    draw is a stage of the verdict (`q` given)."""
    tree = Tree([anchor], [-1], [0], [0], [1.0], [list(c) for c in candidates], confidence, q)
    frontier: list[tuple[float, int, int, int, int]] = []  # (-value, order, parent, depth, rank)
    order = 0
    where: dict[tuple[int, int], int] = {}  # (parent, token) -> node, for merging

    def push(parent: int, value: float, depth: int, rank: int) -> None:
        nonlocal order
        sure = confidence[depth - 1][rank] if confidence is not None and rank != LOOKUP else None
        heapq.heappush(frontier, (-value * rates.rate(depth, rank, sure), order, parent, depth, rank))
        order += 1

    def drafter_children(node: int, depth: int) -> None:
        for r in range(len(candidates[depth]) if depth < len(candidates) else 0):
            push(node, tree.values[node], depth + 1, r)

    def lookup_child(node: int, depth: int) -> None:
        if depth < len(lookup):
            push(node, tree.values[node], depth + 1, LOOKUP)

    drafter_children(0, 0)
    lookup_child(0, 0)
    while len(tree) < budget and frontier:
        neg, _, parent, depth, rank = heapq.heappop(frontier)
        token = lookup[depth - 1] if rank == LOOKUP else candidates[depth - 1][rank]
        node = where.get((parent, token)) if merge else None
        if node is None:  # a new node, whose own kind of children become candidates
            node = len(tree)
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.depths.append(depth)
            tree.ranks.append(rank)
            tree.values.append(-neg)
            where[(parent, token)] = node
        # a merged node (lookup and drafter agree) gains the other kind's children
        (lookup_child if rank == LOOKUP else drafter_children)(node, depth)
    return tree


def truncate(tree: Tree, n: int) -> Tree:
    """The tree of its first n nodes (a parent always precedes its children)."""
    return Tree(tree.tokens[:n], tree.parents[:n], tree.depths[:n], tree.ranks[:n], tree.values[:n],
                tree.candidates, tree.confidence, tree.q)


@dataclass
class Plan:
    """The best trees of n = 1..budget nodes, before any draft exists (their values depend on the
    rates only): expected tokens, and how deep the drafter's nodes reach (the block to draft)."""

    expected: list[float]  # [n - 1]: expected tokens of the tree of n nodes
    drafter_depth: list[int]  # [n - 1]: the deepest drafter node among its nodes


def plan_trees(rates: TreeRates, depth: int, budget: int, width: int = WIDTH, lookup: int = 0) -> Plan:
    cands = [[-(2 + d * width + r) for r in range(width)] for d in range(depth)]  # placeholder tokens
    tree = build_tree(cands, -1, budget, rates, lookup=[-10**9 - d for d in range(lookup)], merge=False)
    expected, deepest, total, reach = [], [], 0.0, 0
    for v, d, r in zip(tree.values, tree.depths, tree.ranks):
        total += v
        reach = max(reach, d if r != LOOKUP else 0)
        expected.append(total)
        deepest.append(reach)
    pad = budget - len(expected)
    return Plan(expected + [total] * pad, deepest + [reach] * pad)


def draft_candidates(draft_probs_or_logits: torch.Tensor, width: int, sampled: bool,
                     generator: torch.Generator | None = None) -> list[list[int]]:
    """[D, V] -> per position, `width` candidates: the top tokens (logits or probs), or draws from
    the probs without replacement (never more than a row's support)."""
    if not sampled:
        return top_ids(draft_probs_or_logits, min(width, draft_probs_or_logits.shape[-1])).tolist()
    support = int((draft_probs_or_logits > 0).sum(-1).min())
    return torch.multinomial(draft_probs_or_logits, min(width, support), replacement=False,
                             generator=generator).tolist()
