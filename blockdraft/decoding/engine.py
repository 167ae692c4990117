"""Speculative decoding with a DFlash drafter, and plain decoding through the same loop.

`Batch.step` is the whole algorithm, top to bottom, over the states of the sequences decoded
together (`Sequence`; a lone request is a batch of one): plan (planner.py: with several
sequences, the batch's block from the cost of a step of that many); per sequence, propose
(proposers/: prompt lookup, the drafter's chain, or its token tree with the lookup as a branch;
each a draft, tree.py's `Tree`, a chain the tree whose parents are i - 1); one target forward
over every sequence's draft (slots.py: one cache, a row per sequence); per sequence, the verdict
(verify.py's `verify`, one verifier for every shape) and the commit of the accepted path plus
one token, the cache keeping exactly those; the policies learn from the step's record. A
sequence joins with the prefill of its prompt (`Batch.join`) and leaves when it stops. Without a
drafter every step is one plain autoregressive token (the honest baseline). `decode_steps` runs
one request to its end; `Engine.generate` returns its `GenerationResult`."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .gumbel import Chooser, PositionNoise
from ..models.checkpoint import check_fits
from ..models.draft import DraftCache, DraftModel
from ..ops.norms import fuse_norms
from ..ops.packed import prepack
from ..ops.precision import draft_precision
from .planner import Planner, StepRecord
from .policies import Policies
from .proposers import LOOKUP_BLOCK, DraftWanted, Proposal, Proposers, draft_blocks  # noqa: F401  (LOOKUP_BLOCK: re-exported)
from .proposers import chain as chain_proposer, lookup as lookup_proposer, tree as tree_proposer
from .slots import OwnCache, RowBlock, SlotCache
from .state import (  # noqa: F401  (re-exported: what callers of the engine use)
    GenerationConfig, GenerationResult, GenerationStats, Step, StepSeconds, StepTimer, Stopper, add_counts,
    validate_request,
)
from ..models.target import Target, TargetOutput
from .text import TextStream, cut_at_stop_string, decode_text  # noqa: F401  (TextStream: re-exported)
from .tree import Tree
from .verify import FIRST_CHUNK, SamplingParams, Verdict, verify  # noqa: F401  (SamplingParams: re-exported)


@dataclass(eq=False)  # identity: `Batch.leave` finds a sequence in a list, and fields hold tensors
class Sequence:
    """One request's decoding state: where it stands, what its drafter has seen, how it stops."""

    prompt_ids: list[int]
    config: GenerationConfig
    stats: GenerationStats
    proposers: Proposers
    stopper: Stopper
    gen: torch.Generator | None  # the request's own draws with rejection sampling (else None)
    choose: Chooser  # its token at a position from the target's row there (greedy, or Gumbel-coupled)
    taps: list[int] | None  # the target layers its drafter reads (None: no drafter)
    context: int  # the target's context length
    anchor: int = 0  # the last committed token, not yet in the cache
    position: int = 0  # the anchor's absolute position
    pending_taps: list = field(default_factory=list)  # chunks [1, T_i, K*H] not yet in the draft cache
    draft_cache: DraftCache | None = None
    t0: float | None = None  # the clock at its first decode step

    @property
    def done(self) -> bool:
        return self.stopper.finish_reason is not None

    @property
    def room(self) -> int:
        """The largest block this step may verify: the budget left and the context left."""
        return min(self.stopper.budget - len(self.stopper.generated) + 1, self.context - self.position)


def start(target: Target, draft: DraftModel | None, prompt_ids: list[int], config: GenerationConfig,
          stats: GenerationStats, policies: Policies, clock: Callable[[], float]) -> tuple[Sequence, object, Step]:
    """Check the request, then prefill its prompt into a cache of its own: the first token comes
    from the prompt's last logits; the prompt's taps are the drafter's first context."""
    validate_request(target, prompt_ids, config)
    params = config.sampling
    gen, noise = None, None
    if not params.greedy:
        # a fresh seed for this request alone (torch.seed() would reseed the global generator)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        if config.coupling == "gumbel":
            noise = PositionNoise(seed, target.device)
        else:
            gen = torch.Generator(device=target.device).manual_seed(seed)
    choose = Chooser(params, noise)
    proposers = Proposers.for_request(config, draft is not None, draft.block_size if draft else 1, policies,
                                      config.trees(draft is not None, target.supports_trees))
    taps = draft.cfg.target_layer_ids if draft is not None and proposers.block_size > 1 else None
    budget = min(config.max_new_tokens, target.max_context - len(prompt_ids))
    t0 = clock()
    cache = target.new_cache()
    out = target.forward(torch.tensor([prompt_ids], dtype=torch.long, device=target.device), cache, taps,
                         logits_at=1)
    target.rollback(cache, len(prompt_ids))  # nothing to undo: trims the past a forward records
    seq = Sequence(prompt_ids, config, stats, proposers, Stopper(target, config, budget), gen, choose, taps,
                   target.max_context,
                   anchor=verify(Tree.chain(prompt_ids[-1], []), out.rows, choose, gen, len(prompt_ids) - 1).next_token,
                   position=len(prompt_ids),
                   pending_taps=[out.taps], draft_cache=DraftCache(len(draft.layers)) if taps else None)
    stats.prompt_tokens = len(prompt_ids)
    first = seq.stopper.clip([seq.anchor])
    stats.prefill_seconds = clock() - t0
    stats.finish_reason = seq.stopper.finish_reason
    return seq, cache, Step(first, 0, 0)


def propose(seq: Sequence, target: Target, cap: int | None) -> Proposal | DraftWanted:
    """Step 1, for one sequence: what the target verifies after its anchor, never more than the
    budget or the context can take, nor than `cap` (a batch's choice) where the request adapts.
    Chains: prompt-lookup tokens where they are expected to pay (no forward at all), else the
    drafter's block. Trees: the same lookup-alone steps where the tree's size adapts (a lone
    sequence), else the drafter's candidates and the lookup continuation in one tree.
    Where the drafter must run, what it is asked for (`DraftWanted`)."""
    p = seq.proposers
    room = seq.room
    if cap is not None and p.adapts:
        room = min(room, cap)
    history = seq.prompt_ids + seq.stopper.generated
    if p.tree_budget is None or (p.tree is not None and cap is None):
        # chains, and a lone sequence's adaptive trees: the lookup alone (no draft forward) where it pays
        proposal = lookup_proposer.propose(p, history, room, batched=cap is not None)
        if proposal is not None:
            return proposal
    if p.tree_budget is None:
        block = room if cap is not None and p.chain is not None else chain_proposer.block(p, room)
        if block > 1:
            def finish_chain(drafted) -> Proposal:
                return chain_proposer.propose(p, drafted, seq.anchor, seq.gen, seq.choose, seq.position)

            return DraftWanted(seq, block, finish_chain, p.top)
        return Proposal(Tree.chain(seq.anchor, []), policy=p.chain)
    branch = lookup_proposer.branch(p, history, room)
    depth = min(p.block_size, room) - 1  # block positions the drafter may propose
    size, depth = tree_proposer.budget(p, depth, branch, cap) if depth > 0 else (1, 0)
    if size > 1 and depth > 0:
        def finish(drafted) -> Proposal:
            return tree_proposer.propose(p, drafted, seq.anchor, size, branch, seq.gen, resize=cap is None,
                                         choose=seq.choose, position=seq.position)

        return DraftWanted(seq, depth + 1, finish, p.top, ranked=p.greedy_proposals)
    return Proposal(Tree.chain(seq.anchor, []), policy=p.tree)


def block_of(proposal: Proposal) -> RowBlock:
    """The tokens the target runs for this sequence: the draft's nodes, the anchor first (a chain
    needs no tree mask: the model's causal one is the same)."""
    draft = proposal.draft
    return RowBlock(draft.tokens, None if draft.is_chain else draft)


def commit(seq: Sequence, proposal: Proposal, verdict: Verdict, out: TargetOutput) -> Step:
    """Step 4, for one sequence: commit the anchor and the accepted path's drafts; their taps
    become draft context; the new token is the next anchor. (The cache then keeps the path's
    entries, `Batch.step`; the rest is rolled back.)"""
    path, stats = verdict.path, seq.stats
    accepted = verdict.num_accepted
    committed = [proposal.draft.tokens[i] for i in path[1:]] + [verdict.next_token]
    if proposal.kind == "tree":
        seq.proposers.rates.update(proposal.draft, path)
        stats.count_tree(proposal.draft)
    if seq.taps:
        prefix = path == list(range(len(path)))  # a chain's: a view, no gather
        new_taps = out.taps[:, : len(path)] if prefix else out.taps[:, path]
        # a step that ran no draft forward (plain or lookup) left earlier pending context pending
        seq.pending_taps = [new_taps] if proposal.ran_draft else seq.pending_taps + [new_taps]
    seq.position += 1 + accepted
    seq.anchor = verdict.next_token
    emitted = seq.stopper.clip(committed)
    stats.lookup_steps += proposal.looked_up
    stats.acceptance_lengths.append(len(emitted))
    stats.drafted += proposal.block - 1  # tokens verified besides the anchor (a tree's nodes)
    stats.accepted += accepted
    stats.finish_reason = seq.stopper.finish_reason
    return Step(emitted, proposal.block - 1, accepted)


class Batch:
    """The sequences decoded together. Each `step` advances every one of them by one verify
    forward of the target (their blocks side by side in one forward); a sequence leaves the batch
    when it stops (or when its caller takes it out: `leave`)."""

    def __init__(self, target: Target, draft: DraftModel | None, policies: Policies,
                 clock: Callable[[], float] = time.perf_counter, max_step_tokens: int | None = None):
        self.target, self.draft, self.policies, self.clock = target, draft, policies, clock
        self.planner = Planner(draft.block_size if draft is not None else None, max_step_tokens)
        # one cache for all (plain attention), else one sequence at a time in a cache of its own
        self.cache = SlotCache() if target.supports_trees else OwnCache(target)
        self.sequences: list[Sequence] = []

    @property
    def capacity(self) -> int | None:
        """How many sequences this target can decode together (None: any number)."""
        return None if isinstance(self.cache, SlotCache) else 1

    def join(self, prompt_ids: list[int], config: GenerationConfig, stats: GenerationStats) -> tuple[Sequence, Step]:
        """Prefill a new request (alone) and add it to the batch; its first step. A request that
        fails its checks raises here, before the batch is touched."""
        seq, cache, first = start(self.target, self.draft, prompt_ids, config, stats, self.policies, self.clock)
        if not seq.done:
            self.cache.join(cache)
            self.sequences.append(seq)
        return seq, first

    def leave(self, seq: Sequence) -> None:
        r = self.sequences.index(seq)
        self.cache.leave(r)
        del self.sequences[r]

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, Step]]:
        """One step of every sequence: plan, propose, verify, commit; each sequence's step, in order."""
        seqs, timer = self.sequences, StepTimer(self.clock)
        for s in seqs:
            s.t0 = timer.start if s.t0 is None else s.t0
        # 1. Plan: with several sequences, the batch's block; 2. propose, per sequence, with one
        # draft forward for all the sequences that draft.
        plan = self.planner.plan(seqs)
        proposals = [timer.each(s, "lookup", propose, s, self.target, plan.cap) for s in seqs]
        wanted = [p for p in proposals if isinstance(p, DraftWanted)]
        if wanted:
            with timer.shared([w.seq for w in wanted], "draft"):
                proposals = self._drafted(proposals, wanted)
        # 3. Verify: one target forward over every sequence's draft (a plain step: its anchor).
        with timer.shared(seqs, "target"):
            out = self.cache.forward(self.target, [block_of(p) for p in proposals],
                                     next((s.taps for s in seqs if s.taps), None))
        parts = out.sequences(FIRST_CHUNK) if len(seqs) > 1 else [out]
        verdicts = [timer.each(s, "verify", verify, p.draft, part.rows, s.choose, s.gen, s.position)
                    for s, p, part in zip(seqs, proposals, parts)]
        # 4. Commit, per sequence; then the cache keeps what was committed, the policies learn.
        steps = [(s, timer.each(s, "commit", commit, s, p, v, part))
                 for s, p, v, part in zip(seqs, proposals, verdicts, parts)]
        with timer.shared(seqs, "commit"):
            self.cache.keep([v.path for v in verdicts])
            self.planner.learn(seqs, StepRecord(proposals, verdicts, timer.elapsed(), plan.load, plan.cap))
        for s, _ in steps:
            s.stats.decode_seconds = self.clock() - s.t0
            if s.done:
                self.leave(s)
        return steps

    def _drafted(self, proposals: list, wanted: list[DraftWanted]) -> list[Proposal]:
        """The proposals with each `DraftWanted` finished from one draft forward for all of them."""
        outputs = draft_blocks(wanted, self.target, self.draft)
        drafted = {id(w): w.finish(out) for w, out in zip(wanted, outputs)}
        return [drafted.get(id(p), p) for p in proposals]


@torch.inference_mode()
def decode_steps(
    target: Target,
    draft: DraftModel | None,
    prompt_ids: list[int],
    config: GenerationConfig,
    stats: GenerationStats | None = None,
    policies: Policies | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Step]:
    """Yield each step's committed tokens of one request (a batch of one). With `draft=None` (or
    block size 1) this is plain autoregressive decoding: the same target forwards, one token per
    step. `policies`: what the adaptive choices learned, kept across requests (the Engine's). With
    `config.lookup`, a step may verify prompt-lookup proposals instead (no draft forward), when its
    own adaptive policy expects them to pay. `clock`: seconds, for the stats and the policies' step
    costs (tests pass a simulated one so that the policies' choices do not depend on timing noise)."""
    stats = stats if stats is not None else GenerationStats()
    batch = Batch(target, draft, policies if policies is not None else Policies(), clock)
    seq, first = batch.join(prompt_ids, config, stats)
    yield first
    while not seq.done:
        yield batch.step()[0][1]


class Engine:
    """A target and an optional drafter, checked against each other once."""

    def __init__(
        self, target: Target, draft: DraftModel | None = None, clock: Callable[[], float] = time.perf_counter,
        draft_dtype: torch.dtype | None = None,
    ):
        """`draft_dtype`: what the drafter computes in (default: the target's). Its numerics cannot
        change the output, so a cheaper dtype is free where the hardware has one (`precision.fast_draft_dtype`)."""
        target.check_exact()  # a target whose cache cannot roll back exactly is refused here, before any work
        if draft is not None:
            check_fits(draft.cfg, target)
            compute, storage = draft_precision(target.device, draft_dtype or target.dtype)
            draft.to(device=target.device, dtype=compute)
            draft.weight_storage = storage  # bf16 weights computed in fp32, where that is the fast bf16
            prepack(draft, storage)  # packed linear layers and fused norms on the CPU, as the target's
            fuse_norms(draft)
        self.target = target
        self.draft = draft
        self.policies = Policies()  # what the adaptive choices learned so far (planner.py)
        self.clock = clock  # what step costs are measured with

    def batch(self, max_step_tokens: int | None = None) -> Batch:
        """An empty batch over this engine's models and policies (the server's continuous batch)."""
        return Batch(self.target, self.draft, self.policies, self.clock, max_step_tokens)

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
