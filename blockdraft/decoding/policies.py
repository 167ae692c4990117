"""What the adaptive choices learned, kept across requests (the Engine's), typed by what each
chooses: the drafter's block (by its largest), prompt lookup's block (by n-gram and largest
block), a tree's acceptance rates (by proposal mode) and node budget, a batch's block (by largest
block and batch size). Sampled requests keep a set per temperature band: acceptance, and so what
pays, falls with the temperature."""

from __future__ import annotations

from dataclasses import dataclass, field

from .adaptive import AdaptiveBlockPolicy, LoadPolicy, TreeBudgetPolicy
from .tree import TreeRates
from .verify import SamplingParams

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
