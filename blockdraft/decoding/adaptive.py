"""Adaptive block size: choose each step's block from running acceptance statistics and the
measured cost of a step, to maximise expected tokens per second, down to plain decoding (B=1).

The output never depends on the block size (verification is lossless for any block), so this
changes speed only. Model:
  expected tokens of a block b:  E(b) = 1 + sum_{k=1}^{b-1} prod_{j<=k} alpha_j
  where alpha_j = P(draft j accepted | drafts 1..j-1 accepted), counted per position with a prior;
  cost of a step with block b:   c(b), measured online (EMA) for the blocks actually run, and
  interpolated linearly between the nearest measured blocks for the others (until chosen); a
  block measured fewer than TRUSTED times costs at most that line, so one slow first step does
  not write it off.
The policy picks argmax_b E(b) / c(b). Plain steps teach nothing about acceptance, so while it
runs plain steps it still probes the full block now and then: after `probe_every` plain steps,
an interval that doubles after each probe that accepts nothing (up to `max_probe_every`), and
resets when a probe is accepted; the steps on which prompt lookup displaced the drafter
(proposers/lookup.py) count as plain steps there, so a cost or acceptance measured badly once is measured
again. The interval is never shorter than what keeps the probes' extra cost, c(B) - c(1) each,
under `probe_budget` of the plain steps' time: a drafter that never helps then costs at most that.
While the drafter runs, a block's cost is measured again where it is stale and may pay: every
`recheck_every` steps, the block with the best rate among those whose cost was not measured for
`stale_after` steps and that would beat the chosen one by `recheck_gain` at `optimism` of their
cost (but no less than the chosen one's for a longer block, a plain step's for a shorter one)
runs once. A machine whose speed drifts, or early steps slowed by first calls, leave costs
measured in another state; without this, a block written off once was never run again, and the
line between measured blocks wrote off its neighbours.
The engine keeps one policy across requests (the drafter's acceptance and the machine's costs do
not change between them), so only its first request pays for learning them; counts are halved
past `memory` observations so that it keeps adapting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TRUSTED = 3  # measures of a block after which its cost stands alone (before: at most its neighbours' line)


@dataclass
class AdaptiveBlockPolicy:
    max_block: int
    probe_every: int = 16
    max_probe_every: int = 256
    prior_accept: float = 0.5  # prior mean of each alpha_j, weight `prior_weight` observations
    prior_weight: float = 2.0
    ema: float = 0.3
    probe_budget: float = 0.02  # probes may add at most this fraction to plain decoding's time
    memory: int = 2000  # per-position observations kept at full weight
    tried: list[int] = field(default_factory=list)  # per position j: steps that reached draft j
    passed: list[float] = field(default_factory=list)  # ... and accepted it
    cost: dict[int, float] = field(default_factory=dict)  # block -> EMA seconds per step
    prior_cost: dict[int, float] = field(default_factory=dict)  # block -> seconds expected before any measure
    measures: dict[int, int] = field(default_factory=dict)  # block -> steps measured
    steps_since_probe: int = 0
    interval: int = 0  # current probe interval (starts at probe_every)
    probing: bool = False
    recheck_every: int = 32  # steps between re-measures of stale costs (at most one each time)
    stale_after: int = 128  # steps after which a block's cost measure is stale
    optimism: float = 0.5  # a stale measure may be this far above the truth (but not below the best's cost)
    recheck_gain: float = 1.05  # ... and a re-measure must hope for this much more than the best block's rate
    steps: int = 0  # choices made
    measured_at: dict[int, int] = field(default_factory=dict)  # block -> the step of its last measure
    last_recheck: int = 0
    guess: int | None = None  # the last choice where it was the best rate's (None: a measure, see `choose`)

    def __post_init__(self):
        self.tried = [0] * self.max_block
        self.passed = [0.0] * self.max_block
        self.interval = self.probe_every

    def alphas(self) -> list[float]:
        w, m = self.prior_weight, self.prior_accept
        return [(self.passed[j] + w * m) / (self.tried[j] + w) for j in range(1, self.max_block)]

    def expected_tokens(self, block: int) -> float:
        total, run = 1.0, 1.0
        for a in self.alphas()[: block - 1]:
            run *= a
            total += run
        return total

    def step_cost(self, block: int) -> float | None:
        """The measured cost of this block, else a straight line between the nearest measured
        blocks on either side (a forward's cost is not smooth in its tokens on a CPU: t(2) may
        cost what t(8) does, so each block is measured once it is ever chosen). Until a block has
        `TRUSTED` measures its cost is at most that line: one slow first step (a kernel's first
        call at a new row count, another process) must not keep a block from being tried again,
        while the blocks run often have long since settled to their true cost."""
        known = {**self.prior_cost, **self.cost}  # a measure overrides an expectation
        below = max((b for b in known if b < block), default=None)
        above = min((b for b in known if b > block), default=None)
        line = None
        if below is not None and above is not None:
            lo, hi = known[below], known[above]
            line = lo + (hi - lo) * (block - below) / (above - below)
        if block not in known:
            return line
        if line is not None and block in self.cost and self.measures.get(block, 0) < TRUSTED:
            return min(known[block], line)
        return known[block]

    def rate(self, block: int) -> float | None:
        """Expected tokens per second of a step with this block; None until its cost is known."""
        cost = self.step_cost(block)
        return self.expected_tokens(block) / cost if cost else None

    def best_rate(self) -> float | None:
        rates = [self.rate(b) for b in range(1, self.max_block + 1)]
        return None if None in rates else max(rates)

    def choose(self) -> int:
        # Measure both ends of the cost curve first (unless expected already): the full block, then
        # a plain step, each twice (a first call can cost many times the next: kernels that
        # measure or pack themselves on it, record keeps the lower).
        self.guess = None
        for end in (self.max_block, 1):
            if end not in self.prior_cost and (end not in self.cost or self.measures.get(end) == 1):
                return end
        if self.probing:  # a probe was due where another proposer displaced this one (count_idle_step)
            return self.max_block
        self.steps += 1
        best = max(range(1, self.max_block + 1), key=self.rate)
        if best == 1 and self.count_idle_step():
            return self.max_block
        stale = self.stale_block(best)
        if stale is None:
            self.guess = best
        return stale or best

    def stale_block(self, best: int) -> int | None:
        """A block to measure again instead of `best` (see the module doc), or None. Only while the
        drafter runs (best > 1): while plain steps are best, the probes measure it again. A plain
        step is a candidate too: one plain step measured slow (a first call, another process) would
        otherwise keep the drafter running where it does not pay, never measured again."""
        if best == 1 or self.steps - self.last_recheck < self.recheck_every:
            return None
        top, bar = None, self.recheck_gain * self.rate(best)
        for b in range(1, self.max_block + 1):
            if b == best or self.steps - self.measured_at.get(b, -self.stale_after) < self.stale_after:
                continue
            # a longer block never costs less than a shorter one (a plain step: no floor)
            floor = self.step_cost(best) if b > best else self.step_cost(1) if b > 1 else 0.0
            hoped = self.expected_tokens(b) / max(floor, self.optimism * self.step_cost(b))
            if hoped > bar:
                top, bar = b, hoped
        if top is not None:
            self.last_recheck = self.steps
        return top

    def count_idle_step(self) -> bool:
        """Count a step on which this policy's blocks did not run (a plain step, or another
        proposer's), and say whether the next should run them again, as a probe (see the module
        doc); a due probe is then chosen by the next `choose`."""
        self.steps_since_probe += 1  # (called once both ends' costs are known)
        c1, cmax = self.step_cost(1), self.step_cost(self.max_block)
        extra = max(0.0, cmax - c1)
        floor = math.ceil(extra / (self.probe_budget * c1)) if c1 > 0 else 0
        if self.steps_since_probe < max(self.interval, floor):
            return False
        self.steps_since_probe = 0
        self.probing = True
        return True

    def update(self, block: int, accepted: int, seconds: float) -> None:
        """Record a step: its acceptance and its cost."""
        self.learn(block, accepted)
        self.record(block, accepted, seconds)

    def learn(self, block: int, accepted: int) -> None:
        """Drafts 1..accepted passed, draft accepted+1 (if any) failed."""
        for j in range(1, min(accepted + 2, block)):
            self.tried[j] += 1
            self.passed[j] += 1.0 if j <= accepted else 0.0
            if self.tried[j] > self.memory:
                self.tried[j] //= 2
                self.passed[j] /= 2

    def record(self, block: int, accepted: int, seconds: float) -> None:
        """A step's cost, and whether a probe paid (the part of `update` any acceptance model shares)."""
        if self.probing:
            self.probing = False
            self.interval = self.probe_every if accepted else min(2 * self.interval, self.max_probe_every)
        old = self.cost.get(block)
        self.measures[block] = self.measures.get(block, 0) + 1
        self.measured_at[block] = self.steps
        # A step never runs faster than the machine allows, but often slower (a kernel's first
        # call measuring itself, a page fault, another process): a lower measure replaces the
        # estimate at once, a higher one moves it by the EMA. One slow step then does not keep
        # a block from being chosen again once it is measured again.
        self.cost[block] = seconds if old is None else min(seconds, (1 - self.ema) * old + self.ema * seconds)


@dataclass
class TreeBudgetPolicy(AdaptiveBlockPolicy):
    """The same choice over a token tree's node budget n (tree.py): E(n) is the expected value of
    the best tree of n nodes under the learned (depth, rank) rates (`plan` sets it before each
    choice), c(n) the measured cost of a step verifying n tokens, the draft forward included;
    n = 1 is a plain step. A chain of b is one of these trees, so this also chooses chain or tree."""

    expected: list[float] = field(default_factory=list)  # E(n) for n = 1..max_block

    def plan(self, expected: list[float]) -> None:
        self.expected = expected

    def expected_tokens(self, block: int) -> float:
        return self.expected[block - 1]  # acceptance: the tree's rates (tree.TreeRates), learned at commit

    def best_size(self, expected: list[float], chosen: int) -> int:
        """After the draft: the size n >= 2 whose expected tokens (`expected[n - 1]`, the draft's
        own tree) per measured second of a step are highest, among sizes whose cost is known (the
        draft forward, paid already, is in each alike); `chosen`, the size planned before the
        draft, where it was a measure rather than a best guess (the ends of the cost curve, a
        probe, a stale cost: `choose`) or where no cost is known."""
        if chosen != self.guess:
            return min(chosen, len(expected))
        rates = {n: expected[n - 1] / c for n in range(2, len(expected) + 1) if (c := self.step_cost(n))}
        return max(rates, key=rates.get) if rates else min(chosen, len(expected))


@dataclass
class SequenceRates(AdaptiveBlockPolicy):
    """One request's own acceptance per block position: the engine's shared rates when it
    started, worth `prior_weight` steps, moved by its own steps. A batch's block is chosen from its
    sequences' rates (`LoadPolicy.plan`), so code the drafter predicts well beside chat it predicts
    poorly gets the block their mix pays for, not the average of past requests."""

    prior_weight: float = 8.0
    prior: list[float] = field(default_factory=list)  # alpha_j for j = 1..max_block-1

    def alphas(self) -> list[float]:
        w = self.prior_weight
        return [(self.passed[j] + w * self.prior[j - 1]) / (self.tried[j] + w) for j in range(1, self.max_block)]


@dataclass
class LoadPolicy(AdaptiveBlockPolicy):
    """A batch's block choice (`load_policy`): its costs are those of steps over this many
    sequences; its expected tokens per sequence, the mean of its sequences' own (`plan`, before
    each choice), else the `shared` chain's, which learns the acceptance of every step whatever
    its batch (`learn` is the chain's)."""

    shared: AdaptiveBlockPolicy | None = None  # the drafter chain's policy: the acceptance
    expected: list[float] = field(default_factory=list)  # E(b) for b = 1..max_block

    def plan(self, expected: list[float]) -> None:
        self.expected = expected

    def expected_tokens(self, block: int) -> float:
        return self.expected[block - 1] if self.expected else self.shared.expected_tokens(block)

    def learn(self, block: int, accepted: int) -> None:
        self.shared.learn(block, accepted)


def load_policy(loads: dict, chain: AdaptiveBlockPolicy, batch: int) -> LoadPolicy:
    """The block choice for steps over `batch` sequences at once (decoding.Batch): the drafter's
    acceptance does not depend on the load, so its expected tokens are the sequences' own rates
    (`plan`) or the chain's, learned by every step whatever its batch; the cost of a step is measured for each batch size apart, since one forward over B
    blocks of b tokens costs neither B times nor once a forward of b. So a lone request
    speculates as wide as pays, and a full batch narrows down to plain steps where that pays.
    A new batch size B expects, until it measures them, its nearest smaller neighbour B''s costs:
    the plain step's as it is (a little low, so it is measured first where it looks best), and
    what speculating adds over a plain step times B / B' (every sequence drafts, and its block's
    tokens join the forward). That spares each new batch size a first step of full blocks, and
    exploring blocks that a neighbour already found not to pay. `loads`: the policies by (largest
    block, batch size)."""
    key = (chain.max_block, batch)
    policy = loads.get(key)
    if policy is None:
        policy = loads[key] = LoadPolicy(chain.max_block, shared=chain)
        smaller = max((b for b in range(1, batch) if b == 1 or (chain.max_block, b) in loads), default=1)
        near = chain if smaller == 1 else loads[(chain.max_block, smaller)]
        known = {k: near.step_cost(k) for k in range(1, chain.max_block + 1)}
        plain = known[1]
        policy.prior_cost = {k: c if plain is None else plain + (c - plain) * batch / smaller
                             for k, c in known.items() if c is not None}
    return policy
