"""What a request asks for and what it gets back: its configuration, the steps it yields, its
statistics and result, the checks every request passes before any work (`validate_request`), and
the stop conditions (`Stopper`). engine.py runs requests; the server and the bench read these."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..errors import BlockdraftError
from ..models.target import Target
from .tree import Tree
from .verify import SamplingParams


STOP_WINDOW_TOKENS = 32  # stop strings are looked for in the text of this many last tokens
DEFAULT_TREE = 16  # greedy decoding verifies token trees of up to 16 nodes unless told otherwise (docs/trees.md)


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    block_size: int | None = None  # None: adaptive up to the drafter's block size (see adaptive.py)
    adaptive: bool = True  # with block_size None: choose each step's block; False: always the drafter's
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None: the target's EOS ids
    coupling: str = "gumbel"  # at T > 0: "gumbel" ties each position's draw to the seed (gumbel.py: the text
    # does not depend on the schedule); "rejection": drafts verified by rejection sampling (verify.py)
    proposal: str = "sample"  # with rejection sampling: "sample" drafts from q, "greedy" proposes argmax q
    lookup: bool = True  # also propose prompt-lookup continuations (lookup.py) where they pay
    tree_budget: int | str | None = "auto"  # verify token trees of up to this many nodes instead of chains
    # (tree.py): adaptive n with block_size None (down to plain steps), else always this many; lookup as a
    # branch. "auto": `trees` decides; None: chains

    def trees(self, has_draft: bool, supports_trees: bool) -> int | None:
        """The node budget this request verifies (None: chains). "auto": trees of up to DEFAULT_TREE
        nodes where they were measured ahead (greedy, adaptive blocks, a drafter, a target whose
        cache can keep a tree's path), chains elsewhere (at a fixed block a tree would verify all
        its nodes every step). The library, the CLI and the server all decode by this rule."""
        if self.tree_budget != "auto":
            return self.tree_budget
        ahead = self.block_size is None and self.adaptive and self.sampling.greedy and has_draft and supports_trees
        return DEFAULT_TREE if ahead else None

    def validate(self) -> "GenerationConfig":
        """Every field in range, before any work (whatever the target: `validate_request` adds its checks)."""
        self.sampling.validate()
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= 1_000_000:
            raise BlockdraftError(f"max_new_tokens must be an integer in [1, 1000000] (got {self.max_new_tokens})")
        if self.block_size is not None and not 1 <= self.block_size <= 256:
            raise BlockdraftError(f"block_size must be in [1, 256] (got {self.block_size})")
        if self.coupling not in ("gumbel", "rejection"):
            raise BlockdraftError(f"coupling must be 'gumbel' or 'rejection' (got {self.coupling!r})")
        if self.proposal not in ("sample", "greedy"):
            raise BlockdraftError(f"proposal must be 'sample' or 'greedy' (got {self.proposal!r})")
        t = self.tree_budget
        if t not in (None, "auto") and not (isinstance(t, int) and 1 <= t <= 256):
            raise BlockdraftError(f"tree_budget must be in [1, 256], 'auto' or None for chains (got {t!r})")
        return self


@dataclass
class Step:
    tokens: list[int]  # committed this step (accepted drafts + bonus/recovered), after stops
    num_drafted: int  # block size - 1 (0 for a plain step)
    num_accepted: int


@dataclass
class StepSeconds:
    """Where the decode steps' time went, summed over steps (read with the engine's clock; on
    CUDA, without syncs, a phase is charged for its launches and the verdict's sync for the rest)."""

    lookup: float = 0.0  # proposing without the drafter: the prompt-lookup search, a tree's plan
    draft: float = 0.0  # the draft forward (context projection, layers, head) and the proposals
    target: float = 0.0  # the target forward over [anchor, drafts] (its body and taps)
    verify: float = 0.0  # the target's LM head on the rows read and the verdict
    commit: float = 0.0  # cache rollback, draft-context bookkeeping, policies, stop checks

    def add(self, phase: str, seconds: float) -> None:
        setattr(self, phase, getattr(self, phase) + seconds)

    def as_dict(self) -> dict:
        return dict(vars(self))


class StepTimer:
    """A batch step's clock: each phase's seconds charged to the sequences it served (a shared
    phase, such as the one target forward, to each of them whole: each waited for all of it)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.start = clock()

    def each(self, seq, phase: str, fn: Callable, *args):
        """fn(*args), its seconds charged to `seq` alone."""
        t = self.clock()
        out = fn(*args)
        seq.stats.step_seconds.add(phase, self.clock() - t)
        return out

    @contextmanager
    def shared(self, seqs: list, phase: str) -> Iterator[None]:
        t = self.clock()
        yield
        elapsed = self.clock() - t
        for s in seqs:
            s.stats.step_seconds.add(phase, elapsed)

    def elapsed(self) -> float:
        return self.clock() - self.start


def add_counts(total: list[int], counts: list[int]) -> None:
    """total[i] += counts[i], total growing as needed (nodes per depth summed over trees)."""
    total.extend([0] * (len(counts) - len(total)))
    for i, c in enumerate(counts):
        total[i] += c


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per decode step
    drafted: int = 0
    accepted: int = 0
    lookup_steps: int = 0  # steps that verified prompt-lookup proposals instead of the drafter's
    step_seconds: StepSeconds = field(default_factory=StepSeconds)
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    tree_sizes: list[int] = field(default_factory=list)  # nodes of each tree verified (root included)
    tree_nodes_by_depth: list[int] = field(default_factory=list)  # summed over those trees

    def count_tree(self, tree: Tree) -> None:
        self.tree_sizes.append(len(tree))
        add_counts(self.tree_nodes_by_depth, tree.shape())

    @property
    def tau(self) -> float:
        """Mean acceptance length (accepted drafts + 1 per step); 1.0 for plain decoding."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 1.0

    def histogram(self, block_size: int) -> list[int]:
        """Counts of acceptance lengths 1..block_size."""
        counts = [0] * block_size
        for a in self.acceptance_lengths:
            counts[min(a, block_size) - 1] += 1
        return counts


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only
    text: str
    finish_reason: str  # "stop" or "length"
    stats: GenerationStats

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


class Stopper:
    """EOS ids, stop strings and the length limit; truncates a step's tokens where one hits."""

    def __init__(self, target: Target, config: GenerationConfig, budget: int):
        ids = config.stop_token_ids if config.stop_token_ids is not None else target.stop_token_ids
        self.stop_ids = set(ids)
        self.stop_strings = [s for s in config.stop_strings if s]
        self.tokenizer = target.tokenizer
        self.budget = budget
        self.generated: list[int] = []
        self.finish_reason: str | None = None

    def clip(self, tokens: list[int]) -> list[int]:
        out = []
        for tok in tokens:
            out.append(tok)
            self.generated.append(tok)
            if tok in self.stop_ids or (self.stop_strings and self._hit_stop_string()):
                self.finish_reason = "stop"
                break
            if len(self.generated) >= self.budget:
                self.finish_reason = "length"
                break
        return out

    def _hit_stop_string(self) -> bool:
        tail = self.tokenizer.decode(self.generated[-STOP_WINDOW_TOKENS:], skip_special_tokens=False)
        return any(s in tail for s in self.stop_strings)


def check_trees(target: Target, tree_budget: int | str | None) -> None:
    """Trees asked for (a budget; "auto" gives chains where trees cannot run) on a target whose
    cache can keep a tree's path, refused before any work."""
    if isinstance(tree_budget, int) and not target.supports_trees:
        raise BlockdraftError(f"tree verification needs a cache of plain attention layers; target "
                              f"{target.name!r} has {sorted(set(target.cache_kinds))}")


def validate_request(target: Target, prompt_ids: list[int], config: GenerationConfig) -> None:
    config.validate()
    if not prompt_ids:
        raise BlockdraftError("the prompt is empty: at least one token is needed")
    if len(prompt_ids) >= target.max_context:
        why = f" ({target.name!r}: {target.rope_limit.reason()})" if target.rope_limit is not None else ""
        raise BlockdraftError(
            f"the prompt has {len(prompt_ids)} tokens; the target's context is {target.max_context}{why}"
        )
    check_trees(target, config.tree_budget)
    bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
    if bad:
        raise BlockdraftError(f"prompt token ids {bad[:5]} are outside the vocabulary of {target.vocab_size}")
