"""One bench method's figures, summed over prompts: what `run_bench` reports and what its journal
(journal.py) stores per prompt, so that a resumed run adds up to the same totals."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..decoding.state import GenerationStats, add_counts


@dataclass
class MethodResult:
    tokens: int = 0
    seconds: float = 0.0  # end to end, prefill included
    decode_seconds: float = 0.0  # after the first token (our engine only)
    decode_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)  # per request
    lookup_steps: int = 0
    drafted: int = 0  # tokens verified besides the anchors (a tree's nodes)
    accepted: int = 0
    tree_sizes: list[int] = field(default_factory=list)
    tree_nodes_by_depth: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    step_seconds: dict[str, float] = field(default_factory=dict)  # our engine: decode time by phase

    def step_ms(self) -> dict | None:
        """Milliseconds per decode step by phase (StepSeconds), our engine only."""
        steps = len(self.acceptance_lengths)
        if not steps or not self.step_seconds:
            return None
        return {k: round(1e3 * v / steps, 2) for k, v in self.step_seconds.items()}

    def summary(self, block_size: int) -> dict:
        hist = GenerationStats(acceptance_lengths=self.acceptance_lengths).histogram(block_size)
        return {
            "tokens": self.tokens, "seconds": round(self.seconds, 3),
            "tok_s": round(self.tokens / self.seconds, 2) if self.seconds else None,
            "decode_tok_s": round(self.decode_tokens / self.decode_seconds, 2) if self.decode_seconds else None,
            "tau": round(sum(self.taus) / len(self.taus), 3) if self.taus else None,
            "acceptance_histogram": hist,
            **({"lookup_steps": self.lookup_steps} if self.lookup_steps else {}),
            **({"accepted_per_verified": round(self.accepted / self.drafted, 3)} if self.drafted else {}),
            **({"trees": self.tree_summary()} if self.tree_sizes else {}),
            **({"step_ms": self.step_ms()} if self.step_ms() else {}),
        }

    def tree_summary(self) -> dict:
        """The trees actually verified: how many steps, their mean size, nodes per depth on average."""
        n = len(self.tree_sizes)
        return {"steps": n, "of_steps": len(self.acceptance_lengths),
                "mean_nodes": round(sum(self.tree_sizes) / n, 2),
                "nodes_by_depth": [round(c / n, 2) for c in self.tree_nodes_by_depth]}

    def add(self, other: "MethodResult") -> None:
        """Add another run's figures (one prompt's, from a journal) to these."""
        for name, value in asdict(other).items():
            if name == "tree_nodes_by_depth":
                add_counts(self.tree_nodes_by_depth, value)
            elif name == "step_seconds":
                for phase, seconds in value.items():
                    self.step_seconds[phase] = self.step_seconds.get(phase, 0.0) + seconds
            else:
                setattr(self, name, getattr(self, name) + value)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MethodResult":
        return cls(**d)
