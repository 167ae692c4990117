"""What the adaptive choices learn, and a batch step planned and learned from it.

- `Policies`: everything learned, kept across requests (the Engine's), typed by what it chooses:
  the drafter's block (by its largest), prompt lookup's block (by n-gram and largest block), a
  tree's acceptance rates (by proposal mode) and node budget, a batch's block (by largest block
  and batch size); sampled requests keep a set per temperature band (acceptance, and so what
  pays, falls with the temperature).
- `Planner.plan`: with several sequences, the block the batch verifies, from the cost of a step of
  that many and what its sequences expect to accept (`LoadPolicy`); alone, each request's own
  policies choose in propose.py.
- `Planner.learn`: each step emits a `StepRecord` (its proposals, verdicts and seconds); alone, a
  policy learns its acceptance and the step's cost; together, each its acceptance, and the
  batch's policy what a step of this many cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .adaptive import AdaptiveBlockPolicy, LoadPolicy, TreeBudgetPolicy, load_policy
from .propose import Proposal
from .tree import TreeRates
from .verify import SamplingParams, Verdict

BANDS = (0.5, 0.85, 1.15)  # temperature bands' upper ends (the last band: above them)


@dataclass
class Policies:
    """What the adaptive choices learned (see the module's docstring)."""

    chains: dict[int, AdaptiveBlockPolicy] = field(default_factory=dict)  # by largest block
    lookups: dict[tuple[int, int], AdaptiveBlockPolicy] = field(default_factory=dict)  # by (n-gram, largest block)
    tree_rates: dict[str, TreeRates] = field(default_factory=dict)  # by mode: greedy, coupled, argmax, sampled
    trees: dict[tuple[int, int, bool], TreeBudgetPolicy] = field(default_factory=dict)  # by (budget, block, lookup)
    loads: dict[tuple[int, int], LoadPolicy] = field(default_factory=dict)  # by (largest block, batch size)
    bands: dict[int, "Policies"] = field(default_factory=dict)  # sampled requests', by temperature band

    def band(self, params: SamplingParams) -> "Policies":
        """A request's: greedy, these; sampled, its temperature band's."""
        if params.greedy:
            return self
        band = next((i for i, top in enumerate(BANDS) if params.temperature <= top), len(BANDS))
        return self.bands.setdefault(band, Policies())

    def chain(self, block: int) -> AdaptiveBlockPolicy:
        return self.chains.setdefault(block, AdaptiveBlockPolicy(block))

    def lookup(self, ngram: int, block: int) -> AdaptiveBlockPolicy:
        return self.lookups.setdefault((ngram, block), AdaptiveBlockPolicy(block))

    def rates(self, mode: str) -> TreeRates:
        return self.tree_rates.setdefault(mode, TreeRates())

    def tree(self, budget: int, block: int, lookup: bool) -> TreeBudgetPolicy:
        return self.trees.setdefault((budget, block, lookup), TreeBudgetPolicy(budget))


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

    def __init__(self, policies: Policies, draft_block: int | None, max_step_tokens: int | None = None):
        self.policies = policies
        self.draft_block = draft_block  # the drafter's block (None: no drafter)
        self.max_step_tokens = max_step_tokens  # with several sequences: blocks of at most this many tokens in all

    def plan(self, sequences: list) -> BatchPlan:
        """With several sequences, the block choice for this many, planned with the sequences'
        expected tokens: a chain's own acceptance; a tree's or a lookup's, the shared chain
        rates; one whose block does not follow the batch's, one token a step."""
        if len(sequences) < 2 or self.draft_block is None:
            return BatchPlan()
        policies = sequences[0].proposers.policies  # the first sequence's temperature band's
        chain = policies.chains.get(self.draft_block)
        if chain is None:
            return BatchPlan()
        load = load_policy(policies.loads, chain, len(sequences))

        def expected(p, block: int) -> float:
            if p.own is not None:
                return p.own.expected_tokens(block)
            return chain.expected_tokens(block) if p.tree is not None or p.lookup_adaptive else 1.0

        load.plan([sum(expected(s.proposers, b) for s in sequences) / len(sequences)
                   for b in range(1, load.max_block + 1)])
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
