"""One request's proposers: its settings and the policies they choose by."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..adaptive import AdaptiveBlockPolicy, SequenceRates, TreeBudgetPolicy
from ..policies import Policies
from ..tree import WIDTH, TreeRates
from ..verify import SamplingParams

LOOKUP_BLOCK = 11  # with `lookup`: anchor + up to 10 proposals (transformers' documented example value)


@dataclass
class Proposers:
    """One request's proposers and the policies they choose by (the engine's, kept across
    requests, unless the request is reproducible: then none adapts to timings)."""

    block_size: int  # the drafter's block for this request (1: no drafter)
    chain: AdaptiveBlockPolicy | None = None  # the drafter chain's block choice
    own: SequenceRates | None = None  # this request's own chain acceptance, set with `chain` (a batch's choice sums them)
    lookup_block: int = 1  # largest lookup block (1: lookup off)
    lookup_adaptive: bool = False
    tree_budget: int | None = None  # largest tree (None: chains)
    tree: TreeBudgetPolicy | None = None  # the tree's node budget choice (None: always tree_budget)
    rates: TreeRates | None = None  # tree acceptance by (depth, rank)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    greedy_proposals: bool = True  # drafts are the drafter's top tokens (else drawn from q)
    coupled: bool = False  # T > 0 with the Gumbel coupling: drafts are the drafter's best perturbed scores (gumbel.py)
    policies: Policies | None = None  # the engine's, for this request's temperature band

    @classmethod
    def for_request(cls, config, has_draft: bool, drafter_block: int, policies: Policies,
                    trees: int | None = None) -> "Proposers":
        """`trees`: the request's node budget (`GenerationConfig.trees`; None: chains)."""
        params = config.sampling
        block_size = 1 if not has_draft else (config.block_size or drafter_block)
        coupled = not params.greedy and config.coupling == "gumbel"
        # Choices follow measured timings. With rejection sampling and a seed they must not, or the
        # same seed could give different text (the draws would fall differently), so a seed fixes
        # them; greedy or Gumbel-coupled, a position's token does not depend on the schedule.
        reproducible = not params.greedy and params.seed is not None and not coupled
        adaptive = config.block_size is None and config.adaptive and not reproducible
        greedy_proposals = params.greedy or coupled or config.proposal == "greedy"
        policies = policies.band(params)
        p = cls(block_size, sampling=params, greedy_proposals=greedy_proposals, coupled=coupled, policies=policies)
        tree = trees is not None and block_size > 1
        if has_draft and adaptive and not tree:
            p.chain = policies.chain(block_size)
            p.own = SequenceRates(block_size, prior=p.chain.alphas())
        if config.lookup:
            p.lookup_block = config.block_size or LOOKUP_BLOCK
            p.lookup_adaptive = adaptive
        if tree:
            p.tree_budget = trees
            mode = "greedy" if params.greedy else "coupled" if coupled else "argmax" if greedy_proposals else "sampled"
            # the rates depend on verdicts only, but a seeded request must not see another's (where
            # the tree's shape changes its text: rejection sampling)
            p.rates = TreeRates() if reproducible else policies.rates(mode)
            if adaptive:
                p.tree = policies.tree(trees, block_size, config.lookup)
        return p

    @property
    def adapts(self) -> bool:
        """Whether this request's block (or tree size) is chosen per step, so a batch may cap it."""
        return self.chain is not None or self.tree is not None or self.lookup_adaptive

    @property
    def top(self) -> int:
        """What a draft forward returns for these proposals (`DraftWanted.top`): greedy, the best
        token ids (one per position for a chain, a tree's `WIDTH` candidates with the drafter's
        probability of each, `Ranked`); sampled, logits (0)."""
        if self.coupled or not self.greedy_proposals:
            return 0
        return WIDTH if self.tree_budget is not None else 1

    @property
    def resizes(self) -> bool:
        """Whether a lone sequence's tree size is chosen again from its draft's own tree (greedy
        proposals, whose confidence tells each step's expected tokens; tree.propose)."""
        return self.tree is not None and self.greedy_proposals
