"""Token trees from one draft forward, verified by one target forward (greedy).

A block-diffusion drafter predicts every block position in one forward, each with a whole
distribution; a chain verifies only the argmax of each. A tree spends the same verify budget
where acceptance is likeliest: the root is the anchor, a node at depth d holds a candidate for
block position d (its rank among that position's draft tokens), and the tree is grown greedily by
each node's expected value, the product of the acceptance rates along its path. The rates, by
(depth, rank), are learned online from the verdicts (`TreeRates`). A chain is the tree of rank 0
everywhere.

The target runs the tree's tokens after its cache in one forward, each attending to the cache and
to its own ancestors only (a 4D mask, positions by depth; `Target.forward_tree`); the greedy
verdict walks from the root while a child holds the target's argmax at its parent; the cache then
keeps exactly the accepted path (`Target.keep_path`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch


@dataclass
class Tree:
    tokens: list[int]  # node i's token; node 0 is the root (the anchor)
    parents: list[int]  # node i's parent (-1 for the root); a parent always precedes its children
    depths: list[int]  # 0 for the root; node at depth d proposes block position d
    ranks: list[int]  # its token's rank among position d's draft candidates (0 = argmax; root 0)

    def __len__(self) -> int:
        return len(self.tokens)

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
        return [i for i, p in enumerate(self.parents) if p == node]


@dataclass
class TreeRates:
    """P(a node is accepted | its parent was) by (depth, rank), counted from verdicts, with a prior
    that halves with each rank (so an unmeasured tree starts close to a chain)."""

    accepted: dict = field(default_factory=dict)
    tried: dict = field(default_factory=dict)
    prior_weight: float = 2.0

    def rate(self, depth: int, rank: int) -> float:
        prior = 0.5 ** (rank + 1)
        key = (depth, rank)
        return (self.accepted.get(key, 0) + self.prior_weight * prior) / (self.tried.get(key, 0) + self.prior_weight)

    def update(self, tree: Tree, path: list[int]) -> None:
        """Every child of an accepted node was tried; the one on the path was accepted."""
        on_path = set(path)
        for i in range(1, len(tree)):
            if tree.parents[i] in on_path:
                key = (tree.depths[i], tree.ranks[i])
                self.tried[key] = self.tried.get(key, 0) + 1
                self.accepted[key] = self.accepted.get(key, 0) + (i in on_path)


def build_tree(draft_logits: torch.Tensor, anchor: int, budget: int, rates: TreeRates, width: int = 4) -> Tree:
    """A tree of at most `budget` nodes (the root included) over draft logits [B-1, V] (row d-1
    proposes position d): nodes added in order of expected value, up to `width` candidates per
    position."""
    k = min(width, draft_logits.shape[-1])
    top = draft_logits.topk(k, dim=-1).indices.tolist()  # [B-1][k] candidates per position, best first
    tree = Tree([anchor], [-1], [0], [0])
    frontier: list[tuple[float, int, int, int]] = []  # (-value, order, parent, rank)
    values = [1.0]

    def push_children(node: int) -> None:
        d = tree.depths[node] + 1
        if d <= len(top):
            for r in range(k):
                heapq.heappush(frontier, (-values[node] * rates.rate(d, r), len(values) * k + r, node, r))

    push_children(0)
    while len(tree) < budget and frontier:
        neg, _, parent, rank = heapq.heappop(frontier)
        d = tree.depths[parent] + 1
        tree.tokens.append(top[d - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(d)
        tree.ranks.append(rank)
        values.append(-neg)
        push_children(len(tree) - 1)
    return tree


@dataclass
class TreeVerdict:
    path: list[int]  # accepted node indices, the root first
    next_token: int  # the target's own token after the path (the bonus)

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def verify_tree_greedy(tree: Tree, argmax_at) -> TreeVerdict:
    """Walk from the root while a child holds the target's argmax at its parent. `argmax_at(i)`:
    the target's greedy token after node i (one row of its logits; read only along the walk)."""
    path = [0]
    while True:
        want = int(argmax_at(path[-1]))
        child = next((c for c in tree.children(path[-1]) if tree.tokens[c] == want), None)
        if child is None:
            return TreeVerdict(path, want)
        path.append(child)
