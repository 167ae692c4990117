"""Speculative decoding with a DFlash drafter, and plain decoding through the same loop.

`decode_steps` is the whole algorithm, top to bottom: prefill, then per step propose (propose.py:
prompt lookup, the drafter's chain, or its token tree with the lookup as a branch), verify with
one target forward (`verify_proposal`: verify.py for chains, tree.py for trees), commit the
accepted tokens plus one and roll the target cache back. Without a drafter every step is one
plain autoregressive token (the honest baseline). `generate` drives it to the end and returns a
`GenerationResult`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .checkpoint import check_fits
from .draft import DraftCache, DraftModel
from .errors import BlockdraftError
from .kernels import prepack
from .propose import LOOKUP_BLOCK, Proposal, Proposers  # noqa: F401  (LOOKUP_BLOCK: re-exported)
from .target import Target, TargetOutput
from .text import TextStream, cut_at_stop_string, decode_text  # noqa: F401  (TextStream: re-exported)
from .tree import Tree, verify_tree_greedy, verify_tree_sampled
from .verify import SamplingParams, probs_from_logits, row_reader, sample, verify_greedy, verify_sampled


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    block_size: int | None = None  # None: adaptive up to the drafter's block size (see adaptive.py)
    adaptive: bool = True  # with block_size None: choose each step's block; False: always the drafter's
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None: the target's EOS ids
    proposal: str = "sample"  # at T > 0: "sample" drafts from q, "greedy" proposes argmax q
    lookup: bool = True  # also propose prompt-lookup continuations (lookup.py) where they pay
    tree_budget: int | None = None  # verify token trees of up to this many nodes instead of chains (tree.py):
    # adaptive n with block_size None (down to plain steps), else always this many; lookup as a branch


@dataclass
class Step:
    tokens: list[int]  # committed this step (accepted drafts + bonus/recovered), after stops
    num_drafted: int  # block size - 1 (0 for a plain step)
    num_accepted: int


@dataclass
class StepSeconds:
    """Where the decode steps' time went, summed over steps (read with the engine's clock; on
    CUDA, without syncs, a phase is charged for its launches and the verdict's sync for the rest)."""

    lookup: float = 0.0  # searching the context for prompt-lookup proposals
    draft: float = 0.0  # the draft forward (context projection, layers, head) and the proposals
    target: float = 0.0  # the target forward over [anchor, drafts] (its body and taps)
    verify: float = 0.0  # the target's LM head on the rows read and the verdict
    commit: float = 0.0  # cache rollback, draft-context bookkeeping, policies, stop checks
    mark: float = field(default=0.0, repr=False)  # the clock at the end of the last phase

    def lap(self, phase: str, now: float) -> None:
        """Charge the time since the last mark to `phase`."""
        setattr(self, phase, getattr(self, phase) + now - self.mark)
        self.mark = now

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "mark"}


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


class _Stopper:
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
        tail = self.tokenizer.decode(self.generated[-32:], skip_special_tokens=False)
        return any(s in tail for s in self.stop_strings)


def _choose(logits: torch.Tensor, params: SamplingParams, gen) -> int:
    """The next token from one row of target logits [V]."""
    if params.greedy:
        return int(logits.argmax())
    return int(sample(probs_from_logits(logits, params), gen))


@dataclass
class Outcome:
    """A step's verdict, whichever proposer's tokens it judged."""

    accepted: int  # draft tokens accepted
    next_token: int  # the bonus or recovered token (a plain step's own token)
    path: list[int] | None = None  # a tree's accepted nodes, the root first


def verify_proposal(out: TargetOutput, proposal: Proposal, params: SamplingParams, gen) -> Outcome:
    """The verdict on a proposal from the target's forward over [anchor, drafts] (or a tree's
    nodes). The LM head runs lazily, on the rows the verdict reads (in chunks, verify.py)."""
    drafts, tree = proposal.drafts, proposal.tree
    if drafts is None:
        return Outcome(0, _choose(out.rows(0, 1)[0], params, gen))
    if tree is not None:
        row = row_reader(out.rows, len(tree))  # nodes are in order of value: the walk reads early rows
        if params.greedy:
            v = verify_tree_greedy(tree, lambda i: row(i).argmax())
        else:
            v = verify_tree_sampled(tree, lambda i: probs_from_logits(row(i), params), gen)
        return Outcome(v.num_accepted, v.next_token, v.path)
    if params.greedy:
        v = verify_greedy(drafts, lambda a, b: out.rows(a, b).argmax(-1))
    else:
        v = verify_sampled(drafts, lambda a, b: probs_from_logits(out.rows(a, b), params), proposal.q, gen)
    return Outcome(v.num_accepted, v.next_token)


def validate_request(target: Target, prompt_ids: list[int], config: GenerationConfig) -> None:
    config.sampling.validate()
    if not prompt_ids:
        raise BlockdraftError("the prompt is empty: at least one token is needed")
    if not isinstance(config.max_new_tokens, int) or not 1 <= config.max_new_tokens <= 1_000_000:
        raise BlockdraftError(f"max_new_tokens must be an integer in [1, 1000000] (got {config.max_new_tokens})")
    if len(prompt_ids) >= target.max_context:
        raise BlockdraftError(
            f"the prompt has {len(prompt_ids)} tokens; the target's context is {target.max_context}"
        )
    if config.block_size is not None and not 1 <= config.block_size <= 256:
        raise BlockdraftError(f"block_size must be in [1, 256] (got {config.block_size})")
    if config.proposal not in ("sample", "greedy"):
        raise BlockdraftError(f"proposal must be 'sample' or 'greedy' (got {config.proposal!r})")
    if config.tree_budget is not None:
        if not 1 <= config.tree_budget <= 256:
            raise BlockdraftError(f"tree_budget must be in [1, 256] (got {config.tree_budget})")
        if not target.supports_trees:
            raise BlockdraftError(f"tree verification needs a cache of plain attention layers; target "
                                  f"{target.name!r} has {sorted(set(target.cache_kinds))}")
    bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
    if bad:
        raise BlockdraftError(f"prompt token ids {bad[:5]} are outside the vocabulary of {target.vocab_size}")


@torch.inference_mode()
def decode_steps(
    target: Target,
    draft: DraftModel | None,
    prompt_ids: list[int],
    config: GenerationConfig,
    stats: GenerationStats | None = None,
    policies: dict | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Step]:
    """Yield each step's committed tokens. With `draft=None` (or block size 1) this is plain
    autoregressive decoding: the same target forwards, one token per step. `policies`: adaptive
    block policies by maximum block, kept across requests (the Engine's). With `config.lookup`,
    a step may verify prompt-lookup proposals instead (no draft forward), when its own adaptive
    policy expects them to pay. `clock`: seconds, for the stats and the policies' step costs
    (tests pass a simulated one so that the policies' choices do not depend on timing noise)."""
    validate_request(target, prompt_ids, config)
    stats = stats if stats is not None else GenerationStats()
    params = config.sampling
    gen = None
    if not params.greedy:
        gen = torch.Generator(device=target.device)
        gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    proposers = Proposers.for_request(config, draft is not None, draft.block_size if draft else 1,
                                      policies if policies is not None else {})
    taps = draft.cfg.target_layer_ids if draft is not None and proposers.block_size > 1 else None
    budget = min(config.max_new_tokens, target.max_context - len(prompt_ids))
    stopper = _Stopper(target, config, budget)
    device = target.device

    # 1. Prefill: the first token comes from the prompt's last logits; the prompt's taps are
    #    the draft's first context.
    t0 = clock()
    cache = target.new_cache()
    out = target.forward(torch.tensor([prompt_ids], dtype=torch.long, device=device), cache, taps, logits_at=1)
    target.rollback(cache, len(prompt_ids))  # nothing to undo: trims the past a forward records
    anchor = _choose(out.rows(0, 1)[0], params, gen)
    pending_taps = [out.taps]  # chunks [1, T_i, K*H] of target taps not yet in the draft cache
    draft_cache = DraftCache(len(draft.layers)) if taps else None
    position = len(prompt_ids)  # absolute position of the anchor (committed, not yet in cache)
    stats.prompt_tokens = len(prompt_ids)
    first = stopper.clip([anchor])
    stats.prefill_seconds = clock() - t0
    yield Step(first, 0, 0)

    def draft_forward(block: int) -> torch.Tensor:
        """The drafter's logits [block - 1, V] for the positions after the anchor."""
        return draft.block_logits(target.embed_tokens, draft.head_for(target.lm_head), draft_cache,
                                  torch.cat(pending_taps, dim=1), anchor, position, block)

    t0 = clock()
    while stopper.finish_reason is None:
        t_step = clock()
        times = stats.step_seconds
        times.mark = t_step
        room = min(budget - len(stopper.generated) + 1, target.max_context - position)  # largest block
        history = prompt_ids + stopper.generated
        # 2. Propose, never more than the budget or the context can take. Chains: prompt-lookup
        #    tokens where they are expected to pay (no forward at all), else the drafter's block.
        #    Trees: the drafter's candidates and the lookup continuation in one tree.
        if proposers.tree_budget is None:
            proposal = proposers.propose_lookup(history, room, device)
            times.lap("lookup", clock())
            if proposal is None:
                block = proposers.chain_block(room)
                proposal = proposers.propose_chain(draft_forward(block), gen) if block > 1 else \
                    Proposal(policy=proposers.chain)
        else:
            branch = proposers.lookup_branch(history, room)
            times.lap("lookup", clock())
            depth = min(proposers.block_size, room) - 1  # block positions the drafter may propose
            size, depth = proposers.tree_size(depth, branch) if depth > 0 else (1, 0)
            proposal = proposers.propose_tree(draft_forward(depth + 1), anchor, size, branch, gen) \
                if size > 1 and depth > 0 else Proposal(policy=proposers.tree)
        times.lap("draft", clock())
        # 3. Verify: one target forward over [anchor, drafts] (or the tree's nodes).
        block_ids = torch.tensor([[anchor]], dtype=torch.long, device=device)
        if proposal.drafts is not None:
            block_ids = torch.cat([block_ids, proposal.drafts[None]], dim=1)  # [1, block]
        out = target.forward(block_ids, cache, taps, tree=proposal.tree)
        times.lap("target", clock())
        outcome = verify_proposal(out, proposal, params, gen)
        accepted, path = outcome.accepted, outcome.path
        times.lap("verify", clock())
        # 4. Commit the anchor and accepted drafts; roll the target cache back past rejected
        #    drafts (a hybrid target's recurrent state takes the kept ones in with the next
        #    forward; a tree keeps the accepted path's entries only). Their taps become draft
        #    context; the new token is the next anchor.
        if path is not None:
            committed = [proposal.tree.tokens[i] for i in path[1:]] + [outcome.next_token]
            target.keep_path(cache, position, path)
            proposers.rates.update(proposal.tree, path)
            stats.count_tree(proposal.tree)
        else:
            committed = (proposal.drafts[:accepted].tolist() if accepted else []) + [outcome.next_token]
            target.rollback(cache, position + 1 + accepted)
        if taps:
            new_taps = out.taps[:, path] if path is not None else out.taps[:, : 1 + accepted]
            # a step that ran no draft forward (plain or lookup) left earlier pending context pending
            pending_taps = [new_taps] if proposal.ran_draft else pending_taps + [new_taps]
        position += 1 + accepted
        anchor = outcome.next_token
        seconds = clock() - t_step
        if proposal.policy is not None:
            proposal.policy.update(proposal.block, accepted, seconds)
        if proposal.block == 1:  # a plain step's cost is c(1) of the lookup policies too
            for other in proposers.lookup.values():
                other.update(1, 0, seconds)
        emitted = stopper.clip(committed)
        stats.lookup_steps += proposal.looked_up
        stats.acceptance_lengths.append(len(emitted))
        stats.drafted += proposal.block - 1  # tokens verified besides the anchor (a tree's nodes)
        stats.accepted += accepted
        stats.decode_seconds = clock() - t0
        times.lap("commit", clock())
        yield Step(emitted, proposal.block - 1, accepted)
    stats.finish_reason = stopper.finish_reason


class Engine:
    """A target and an optional drafter, checked against each other once."""

    def __init__(
        self, target: Target, draft: DraftModel | None = None, clock: Callable[[], float] = time.perf_counter,
        draft_dtype: torch.dtype | None = None,
    ):
        """`draft_dtype`: what the drafter computes in (default: the target's). Its numerics cannot
        change the output, so a cheaper dtype is free where the hardware has one (`kernels.fast_draft_dtype`)."""
        target.check_exact()  # a target whose cache cannot roll back exactly is refused here, before any work
        if draft is not None:
            check_fits(draft.cfg, target)
            draft.to(device=target.device, dtype=draft_dtype or target.dtype)
            prepack(draft)  # oneDNN-packed linear layers on the CPU (kernels.py), as the target's
        self.target = target
        self.draft = draft
        self.policies: dict = {}  # what adaptive blocks learned so far: by maximum block, and "lookup"
        self.clock = clock  # what step costs are measured with

    def stream(self, prompt_ids: list[int], config: GenerationConfig, stats: GenerationStats) -> Iterator[Step]:
        return decode_steps(self.target, self.draft, prompt_ids, config, stats, self.policies, self.clock)

    def generate(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> GenerationResult:
        config = config or GenerationConfig()
        stats = GenerationStats()
        tokens: list[int] = []
        for step in self.stream(prompt_ids, config, stats):
            tokens.extend(step.tokens)
        tok = self.target.tokenizer
        text = decode_text(tok, tokens, config.stop_strings) if tok is not None else ""
        return GenerationResult(tokens, text, stats.finish_reason or "length", stats)
