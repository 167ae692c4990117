"""Speculative decoding with a DFlash drafter, and plain decoding through the same loop.

`Batch.step` is the whole algorithm, top to bottom, over the states of the sequences decoded
together (`Sequence`; a lone request is a batch of one): per sequence, propose (propose.py:
prompt lookup, the drafter's chain, or its token tree with the lookup as a branch); one target
forward over every sequence's block (slots.py: one cache, a row per sequence); per sequence, the
verdict (`verify_proposal`: verify.py for chains, tree.py for trees) and the commit of the
accepted tokens plus one, the cache keeping exactly those. A sequence joins with the prefill of
its prompt (`Batch.join`) and leaves when it stops. Without a drafter every step is one plain
autoregressive token (the honest baseline). With several sequences the block is chosen for the
batch from the cost of a step of that many (adaptive.load_policy). `decode_steps` runs one
request to its end; `Engine.generate` returns its `GenerationResult`."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .adaptive import AdaptiveBlockPolicy, LoadPolicy, load_policy
from .gumbel import Chooser, PositionNoise
from ..models.checkpoint import check_fits
from ..models.draft import DraftCache, DraftModel
from ..models.kernels import draft_precision, prepack
from ..models.norms import fuse_norms
from .propose import LOOKUP_BLOCK, DraftWanted, Proposal, Proposers, draft_blocks  # noqa: F401  (LOOKUP_BLOCK: re-exported)
from .slots import OwnCache, RowBlock, SlotCache
from .state import (  # noqa: F401  (re-exported: what callers of the engine use)
    GenerationConfig, GenerationResult, GenerationStats, Step, StepSeconds, Stopper, add_counts, validate_request,
)
from ..models.target import Target, TargetOutput
from .text import TextStream, cut_at_stop_string, decode_text  # noqa: F401  (TextStream: re-exported)
from .tree import verify_tree_greedy, verify_tree_sampled
from .verify import FIRST_CHUNK, SamplingParams, probs_from_logits, row_reader, sample, verify_greedy, verify_sampled


def _choose(logits: torch.Tensor, choose: Chooser, gen, position: int) -> int:
    """The token at `position` from its row of target logits [V]."""
    if choose.deterministic:
        return int(choose.pick(logits[None], [position])[0])
    return int(sample(probs_from_logits(logits, choose.params), gen))


@dataclass
class Outcome:
    """A step's verdict, whichever proposer's tokens it judged."""

    accepted: int  # draft tokens accepted
    next_token: int  # the bonus or recovered token (a plain step's own token)
    path: list[int] | None = None  # a tree's accepted nodes, the root first


def verify_proposal(out: TargetOutput, proposal: Proposal, choose: Chooser, gen, position: int) -> Outcome:
    """The verdict on a proposal from the target's forward over [anchor, drafts] (or a tree's
    nodes), the anchor at `position`. The LM head runs lazily, on the rows the verdict reads (in
    chunks, verify.py). Greedy or Gumbel-coupled (gumbel.py), the target's token at each position
    is a function of its row, so a verdict is an equality test; else rejection sampling."""
    drafts, tree, params = proposal.drafts, proposal.tree, choose.params
    after = position + 1  # row k predicts the token at position + 1 + k (a tree node's: + its depth)
    if drafts is None:
        return Outcome(0, _choose(out.rows(0, 1)[0], choose, gen, after))
    if tree is not None:
        row = row_reader(out.rows, len(tree))  # nodes are in order of value: the walk reads early rows
        if choose.deterministic:
            v = verify_tree_greedy(tree, lambda i: choose.pick(row(i)[None], [after + tree.depths[i]])[0])
        else:
            v = verify_tree_sampled(tree, lambda i: probs_from_logits(row(i), params), gen)
        return Outcome(v.num_accepted, v.next_token, v.path)
    if choose.deterministic:
        v = verify_greedy(drafts, lambda a, b: choose.pick(out.rows(a, b), list(range(after + a, after + b))))
    else:
        v = verify_sampled(drafts, lambda a, b: probs_from_logits(out.rows(a, b), params), proposal.q, gen)
    return Outcome(v.num_accepted, v.next_token)

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
          stats: GenerationStats, policies: dict, clock: Callable[[], float]) -> tuple[Sequence, object, Step]:
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
    proposers = Proposers.for_request(config, draft is not None, draft.block_size if draft else 1, policies)
    taps = draft.cfg.target_layer_ids if draft is not None and proposers.block_size > 1 else None
    budget = min(config.max_new_tokens, target.max_context - len(prompt_ids))
    t0 = clock()
    cache = target.new_cache()
    out = target.forward(torch.tensor([prompt_ids], dtype=torch.long, device=target.device), cache, taps,
                         logits_at=1)
    target.rollback(cache, len(prompt_ids))  # nothing to undo: trims the past a forward records
    seq = Sequence(prompt_ids, config, stats, proposers, Stopper(target, config, budget), gen, choose, taps,
                   target.max_context, anchor=_choose(out.rows(0, 1)[0], choose, gen, len(prompt_ids)),
                   position=len(prompt_ids),
                   pending_taps=[out.taps], draft_cache=DraftCache(len(draft.layers)) if taps else None)
    stats.prompt_tokens = len(prompt_ids)
    first = seq.stopper.clip([seq.anchor])
    stats.prefill_seconds = clock() - t0
    stats.finish_reason = seq.stopper.finish_reason
    return seq, cache, Step(first, 0, 0)


def propose(seq: Sequence, target: Target, cap: int | None, clock: Callable[[], float]) -> Proposal | DraftWanted:
    """Step 1, for one sequence: what the target verifies after its anchor, never more than the
    budget or the context can take, nor than `cap` (a batch's choice) where the request adapts.
    Chains: prompt-lookup tokens where they are expected to pay (no forward at all), else the
    drafter's block. Trees: the same lookup-alone steps where the tree's size adapts (a lone
    sequence), else the drafter's candidates and the lookup continuation in one tree.
    Where the drafter must run, what it is asked for (`DraftWanted`)."""
    p, times = seq.proposers, seq.stats.step_seconds
    times.mark = clock()
    room = seq.room
    adapts = p.chain is not None or p.tree is not None or p.lookup_adaptive
    if cap is not None and adapts:
        room = min(room, cap)
    history = seq.prompt_ids + seq.stopper.generated
    if p.tree_budget is None or (p.tree is not None and cap is None):
        # chains, and a lone sequence's adaptive trees: the lookup alone (no draft forward) where it pays
        proposal = p.propose_lookup(history, room, target.device, batched=cap is not None)
        times.lap("lookup", clock())
        if proposal is not None:
            return proposal
    if p.tree_budget is None:
        block = room if cap is not None and p.chain is not None else p.chain_block(room)
        if block > 1:
            return DraftWanted(seq, block, lambda drafted: p.propose_chain(drafted, seq.gen, seq.choose, seq.position),
                               p.top)
        return Proposal(policy=p.chain)
    branch = p.lookup_branch(history, room)
    times.lap("lookup", clock())
    depth = min(p.block_size, room) - 1  # block positions the drafter may propose
    size, depth = p.tree_size(depth, branch, cap) if depth > 0 else (1, 0)
    if size > 1 and depth > 0:
        return DraftWanted(seq, depth + 1,
                           lambda drafted: p.propose_tree(drafted, seq.anchor, size, branch, seq.gen, resize=cap is None,
                                                          choose=seq.choose, position=seq.position),
                           p.top, ranked=p.greedy_proposals)
    return Proposal(policy=p.tree)


def block_of(seq: Sequence, proposal: Proposal) -> RowBlock:
    """The tokens the target runs for this sequence: [anchor, drafts] (or the tree's nodes)."""
    drafts = [] if proposal.drafts is None else proposal.drafts.tolist()
    return RowBlock([seq.anchor] + drafts, proposal.tree)


def commit(seq: Sequence, proposal: Proposal, outcome: Outcome, out: TargetOutput) -> tuple[Step, list[int]]:
    """Step 3, for one sequence: commit the anchor and the accepted drafts (a tree's accepted
    path); their taps become draft context; the new token is the next anchor. Returns the step
    and the block indices the cache keeps (the rest is rolled back)."""
    accepted, path, stats = outcome.accepted, outcome.path, seq.stats
    if path is not None:
        committed = [proposal.tree.tokens[i] for i in path[1:]] + [outcome.next_token]
        kept = path
        seq.proposers.rates.update(proposal.tree, path)
        stats.count_tree(proposal.tree)
    else:
        committed = (proposal.drafts[:accepted].tolist() if accepted else []) + [outcome.next_token]
        kept = list(range(1 + accepted))
    if seq.taps:
        new_taps = out.taps[:, path] if path is not None else out.taps[:, : 1 + accepted]
        # a step that ran no draft forward (plain or lookup) left earlier pending context pending
        seq.pending_taps = [new_taps] if proposal.ran_draft else seq.pending_taps + [new_taps]
    seq.position += 1 + accepted
    seq.anchor = outcome.next_token
    emitted = seq.stopper.clip(committed)
    stats.lookup_steps += proposal.looked_up
    stats.acceptance_lengths.append(len(emitted))
    stats.drafted += proposal.block - 1  # tokens verified besides the anchor (a tree's nodes)
    stats.accepted += accepted
    stats.finish_reason = seq.stopper.finish_reason
    return Step(emitted, proposal.block - 1, accepted), kept


class Batch:
    """The sequences decoded together. Each `step` advances every one of them by one verify
    forward of the target (their blocks side by side in one forward); a sequence leaves the batch
    when it stops (or when its caller takes it out: `leave`)."""

    def __init__(self, target: Target, draft: DraftModel | None, policies: dict,
                 clock: Callable[[], float] = time.perf_counter, max_step_tokens: int | None = None):
        self.target, self.draft, self.policies, self.clock = target, draft, policies, clock
        self.max_step_tokens = max_step_tokens  # with several sequences: blocks of at most this many tokens in all
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

    def _load(self) -> LoadPolicy | None:
        """With several sequences, the block choice for this many (None: each its own), planned
        with the sequences' expected tokens: a chain's own acceptance; a tree's or a lookup's, the
        shared chain rates; one whose block does not follow the batch's, one token a step."""
        # the first sequence's temperature band's policies (greedy: the engine's own)
        policies = self.sequences[0].proposers.policies if self.sequences else self.policies
        chain = policies.get(self.draft.block_size) if self.draft is not None else None
        if len(self.sequences) < 2 or not isinstance(chain, AdaptiveBlockPolicy):
            return None
        load = load_policy(policies, chain, len(self.sequences))

        def expected(p: Proposers, block: int) -> float:
            if p.own is not None:
                return p.own.expected_tokens(block)
            return chain.expected_tokens(block) if p.tree is not None or p.lookup_adaptive else 1.0

        load.plan([sum(expected(s.proposers, b) for s in self.sequences) / len(self.sequences)
                   for b in range(1, load.max_block + 1)])
        return load

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, Step]]:
        """One step of every sequence: propose, verify, commit; each sequence's step, in order."""
        seqs, clock = self.sequences, self.clock
        t_step = clock()
        load = self._load()
        cap = None
        if load is not None:
            cap = load.choose()
            if self.max_step_tokens is not None:
                cap = max(1, min(cap, self.max_step_tokens // len(seqs)))
        # 1. Propose, per sequence; one draft forward for all the sequences that draft.
        proposals = []
        for s in seqs:
            s.t0 = t_step if s.t0 is None else s.t0
            proposals.append(propose(s, self.target, cap, clock))
        wanted = [p for p in proposals if isinstance(p, DraftWanted)]
        if wanted:
            t = clock()
            drafted = {id(w): w.finish(out) for w, out in zip(wanted, draft_blocks(wanted, self.target, self.draft))}
            proposals = [drafted.get(id(p), p) for p in proposals]
            seconds = clock() - t  # each drafting sequence waited for the whole draft forward
            for w in wanted:
                w.seq.stats.step_seconds.draft += seconds
        # 2. Verify: one target forward over every sequence's block (or plain token).
        t = clock()
        taps = next((s.taps for s in seqs if s.taps), None)
        out = self.cache.forward(self.target, [block_of(s, p) for s, p in zip(seqs, proposals)], taps)
        t_target = clock() - t
        # 3. Per sequence, the verdict and the commit; then the cache keeps what was committed.
        steps, kept, outcomes = [], [], []
        parts = out.sequences(FIRST_CHUNK) if len(seqs) > 1 else [out]
        for s, p, mine in zip(seqs, proposals, parts):
            times = s.stats.step_seconds
            times.target += t_target
            times.mark = clock()
            outcome = verify_proposal(mine, p, s.choose, s.gen, s.position)
            times.lap("verify", clock())
            step, keep = commit(s, p, outcome, mine)
            steps.append((s, step))
            kept.append(keep)
            outcomes.append(outcome)
            times.lap("commit", clock())
        t = clock()
        self.cache.keep(kept)
        seconds = clock() - t_step
        self._learn(load, cap, proposals, outcomes, seconds)
        for s in seqs:
            s.stats.step_seconds.commit += clock() - t
            s.stats.decode_seconds = clock() - s.t0
        for s, _ in steps:
            if s.done:
                self.leave(s)
        return steps

    def _learn(self, load, cap, proposals: list[Proposal], outcomes: list[Outcome], seconds: float) -> None:
        """The policies learn the step: alone, each its acceptance and the step's cost; together,
        each its acceptance, and the batch's policy what a step of this many cost."""
        for s, p, o in zip(self.sequences, proposals, outcomes):
            if s.proposers.own is not None and p.policy is s.proposers.chain:
                s.proposers.own.learn(p.block, o.accepted)
            if load is not None:
                if p.policy is not None:
                    p.policy.learn(p.block, o.accepted)
                continue
            if p.policy is not None:
                p.policy.update(p.block, o.accepted, seconds)
            if p.block == 1:  # a plain step's cost is c(1) of the lookup policies too
                for other in s.proposers.lookup.values():
                    other.update(1, 0, seconds)
        if load is not None:
            load.record(cap, sum(o.accepted for o in outcomes), seconds)


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
    """Yield each step's committed tokens of one request (a batch of one). With `draft=None` (or
    block size 1) this is plain autoregressive decoding: the same target forwards, one token per
    step. `policies`: what the adaptive choices learned, kept across requests (the Engine's). With
    `config.lookup`, a step may verify prompt-lookup proposals instead (no draft forward), when its
    own adaptive policy expects them to pay. `clock`: seconds, for the stats and the policies' step
    costs (tests pass a simulated one so that the policies' choices do not depend on timing noise)."""
    stats = stats if stats is not None else GenerationStats()
    batch = Batch(target, draft, policies if policies is not None else {}, clock)
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
        change the output, so a cheaper dtype is free where the hardware has one (`kernels.fast_draft_dtype`)."""
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
        self.policies: dict = {}  # what adaptive blocks learned so far: by maximum block, and "lookup"
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
