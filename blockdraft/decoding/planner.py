"""A batch step planned, and learned from, over the engine's `Policies` (policies.py).

- `Planner.plan`: with several sequences, the block the batch verifies, from the cost of a step of
  that many and what its sequences expect to accept (`LoadPolicy`); alone, each request's own
  policies choose in proposers/.
- `Planner.learn`: each step emits a `StepRecord` (its proposals, verdicts and seconds); alone, a
  policy learns its acceptance and the step's cost; together, each its acceptance, and the
  batch's policy what a step of this many cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from .adaptive import LoadPolicy, load_policy
from .proposers import Proposal
from .tree import plan_trees
from .verify import Verdict

@dataclass
class StepRecord:
    """What one batch step did, for the policies to learn."""

    proposals: list[Proposal]  # per sequence, in the batch's order
    verdicts: list[Verdict]
    seconds: float  # the whole step, every sequence's share
    load: LoadPolicy | None = None  # the batch's block choice (None: each sequence chose its own)
    cap: int | None = None  # ... and the block it chose


@dataclass
class BatchPlan:
    load: LoadPolicy | None = None  # None: a lone sequence (or chains the batch cannot follow)
    cap: int | None = None  # the largest block any sequence verifies this step (None: its own choice)


class Planner:
    """A batch's plans and learning over the engine's `Policies` (see the module's docstring)."""

    def __init__(self, draft_block: int | None, max_step_tokens: int | None = None):
        self.draft_block = draft_block  # the drafter's block (None: no drafter)
        self.max_step_tokens = max_step_tokens  # with several sequences: blocks of at most this many tokens in all

    def plan(self, sequences: list) -> BatchPlan:
        """With several sequences, the block choice for this many (a tree's: its node budget),
        planned with the sequences' expected tokens: a chain's own acceptance; a tree's, the best
        tree of that many nodes under its rates; a lookup's, the shared chain rates; one whose
        block does not follow the batch's, one token a step."""
        if len(sequences) < 2 or self.draft_block is None or not any(s.proposers.adapts for s in sequences):
            return BatchPlan()
        policies = sequences[0].proposers.policies  # the first sequence's temperature band's
        chain = policies.chain(self.draft_block)
        load = load_policy(policies.loads, chain, len(sequences))
        blocks = range(1, load.max_block + 1)
        plans: dict[tuple, list[float]] = {}  # the tree plans of this step: sequences of one mode share rates

        def expected(p) -> list[float]:  # E(b) for b in blocks
            if p.own is not None:
                return [p.own.expected_tokens(b) for b in blocks]
            if p.tree is not None:
                key = (id(p.rates), p.block_size, p.tree_budget)
                if key not in plans:
                    plans[key] = plan_trees(p.rates, p.block_size - 1, p.tree_budget).expected
                trees = plans[key]
                return [trees[min(b, len(trees)) - 1] for b in blocks]
            return [chain.expected_tokens(b) if p.lookup_adaptive else 1.0 for b in blocks]

        rows = [expected(s.proposers) for s in sequences]
        load.plan([sum(col) / len(rows) for col in zip(*rows)])
        cap = load.choose()
        if self.max_step_tokens is not None:
            cap = max(1, min(cap, self.max_step_tokens // len(sequences)))
        return BatchPlan(load, cap)

    def learn(self, sequences: list, record: StepRecord) -> None:
        """Alone, each policy its acceptance (a tree's: its rates, at commit) and the step's cost;
        together, each its acceptance, and the batch's policy the cost of a step of this many."""
        together = record.load is not None
        for s, p, v in zip(sequences, record.proposals, record.verdicts):
            accepted = v.num_accepted
            if s.proposers.own is not None and p.policy is s.proposers.chain:
                s.proposers.own.learn(p.block, accepted)
            if p.policy is not None and p.kind != "tree":
                p.policy.learn(p.block, accepted)
            if together:
                continue
            if p.policy is not None:
                p.policy.record(p.block, accepted, record.seconds)
            if p.block == 1:  # a plain step's cost is c(1) of the lookup policies too
                for other in s.proposers.policies.lookups.values():
                    other.record(1, 0, record.seconds)
        if together:
            record.load.record(record.cap, sum(v.num_accepted for v in record.verdicts), record.seconds)
