"""Proposers, side by side: what one decode step asks the target to verify.

- prompt lookup (lookup.py): the continuation of an earlier occurrence of the context's last
  n-gram, no forward at all, verified where its own adaptive policy expects it to pay;
- the drafter's chain: one block-diffusion forward, one token per block position;
- the drafter's tree (tree.py): the same forward, several candidates per position, the lookup
  continuation as one more branch, its node budget chosen from the measured cost of verifying n
  tokens (down to a plain step); where the budget adapts, a lone sequence's step may verify the
  lookup continuation alone instead, as a chain's may.
Each returns a `Proposal`; engine.py verifies it with one target forward and commits. Where the
drafter must run, the step first collects what every sequence asks of it (`DraftWanted`) and runs
one draft forward for all (`draft_blocks`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

from .adaptive import AdaptiveBlockPolicy, SequenceRates, TreeBudgetPolicy
from .lookup import lookup_proposals
from .policies import Policies
from ..models.vocab import Ranked, ranked, top_ids
from .tree import WIDTH, Tree, TreeRates, build_tree, draft_candidates, plan_trees, truncate
from .gumbel import Chooser
from .verify import SamplingParams, probs_from_logits, sample

LOOKUP_BLOCK = 11  # with `lookup`: anchor + up to 10 proposals (transformers' documented example value)


@dataclass
class Proposal:
    """What a step verifies after its anchor: a draft (tree.py's `Tree`: a chain's parents are
    i - 1, a plain step's draft is the anchor alone), who proposed it, and the policy whose choice
    it was (it learns the step's cost)."""

    draft: Tree
    kind: str = "plain"  # plain, lookup (no draft forward), chain or tree (the drafter's)
    policy: AdaptiveBlockPolicy | None = None
    ran_draft: bool = False  # a draft forward ran: the pending draft context went in

    @property
    def block(self) -> int:
        """Tokens the target verifies, the anchor included."""
        return len(self.draft)

    @property
    def looked_up(self) -> bool:
        return self.kind == "lookup"


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

    def propose_lookup(self, history: list[int], room: int, batched: bool = False) -> Proposal | None:
        """Prompt-lookup tokens where they are expected to pay, else None. `batched`: the step is
        one of several sequences whose block the batch chose (`room`); the lookup's tokens are
        free there (no draft forward), so they go instead of the drafter's where they are expected
        to yield as many tokens."""
        found = lookup_proposals(history, min(self.lookup_block, room) - 1) if self.lookup_block > 1 else None
        if not found:
            return None
        policy = None
        if self.lookup_adaptive:
            policy = self.policies.lookup(found.ngram, self.lookup_block)
        if batched:
            tokens = found.tokens
            if policy is not None and self.chain is not None and \
                    policy.expected_tokens(1 + len(tokens)) < self.own.expected_tokens(room):
                return None
            return Proposal(Tree.chain(history[-1], tokens), "lookup", policy)
        tokens = found.tokens[: policy.choose() - 1] if policy else found.tokens
        drafter = self.chain if self.chain is not None else self.tree
        if tokens and policy is not None and drafter is not None:
            # the alternative is the drafter's block or tree, not a plain step: verify the lookup
            # only if it is expected to yield as many tokens per second (while either is
            # unmeasured, try it)
            mine, theirs = policy.rate(1 + len(tokens)), drafter.best_rate()
            if mine is not None and theirs is not None and (mine < theirs or drafter.count_idle_step()):
                return None  # the drafter's turn (now and then as a probe, though the lookup looks better)
        if not tokens:  # its policy expects no lookup token to pay: the drafter's turn
            return None
        return Proposal(Tree.chain(history[-1], tokens), "lookup", policy)  # history[-1]: the anchor

    def lookup_branch(self, history: list[int], room: int) -> list[int]:
        """A tree's lookup branch: the continuation as found (the tree's rates judge it)."""
        if self.lookup_block <= 1:
            return []
        found = lookup_proposals(history, min(self.lookup_block, room) - 1)
        return found.tokens if found else []

    def chain_block(self, room: int) -> int:
        return min(self.chain.choose() if self.chain is not None else self.block_size, room)

    @property
    def top(self) -> int:
        """What a draft forward returns for these proposals (`DraftWanted.top`): greedy, the best
        token ids (one per position for a chain, a tree's `WIDTH` candidates with the drafter's
        probability of each, `Ranked`); sampled, logits (0)."""
        if self.coupled or not self.greedy_proposals:
            return 0
        return WIDTH if self.tree_budget is not None else 1

    def propose_chain(self, drafted: torch.Tensor, anchor: int, gen, choose: Chooser | None = None,
                      position: int = 0) -> Proposal:
        """The chain after `anchor` of n drafts: with greedy proposals the drafter's best token ids
        [n, 1]; coupled, the argmax of its logits [n, V] perturbed by the noise of positions
        position + 1 .. + n; else drawn from its logits, with the q [n, V] they were drawn from."""
        q = None
        if self.coupled:
            drafts = choose.pick(drafted, list(range(position + 1, position + 1 + drafted.shape[0])))
        elif self.greedy_proposals:
            drafts = drafted[:, 0]
        else:
            q = probs_from_logits(drafted, self.sampling)
            drafts = sample(q, gen)
        return Proposal(Tree.chain(anchor, drafts.tolist(), q), "chain", self.chain, ran_draft=True)

    def tree_size(self, depth: int, lookup: list[int], cap: int | None = None) -> tuple[int, int]:
        """This step's node budget (fixed, or the policy's best for the expected value of each n,
        or a batch's choice `cap`) and the block positions the drafter must propose for it (at
        most `depth`). Where the size is chosen again after the draft (`resizes`), the drafter
        proposes as deep as the largest tree reaches: a draft forward grows slowly with its block
        (far less than the verify forward with its tokens), and a sure drafter's tree goes deeper
        than the average plan's."""
        plan = plan_trees(self.rates, depth, self.tree_budget, WIDTH, len(lookup))
        if self.tree is None:
            size = self.tree_budget
        elif cap is not None:
            size = min(cap, self.tree_budget)
        else:
            self.tree.plan(plan.expected)
            size = self.tree.choose()
            if size > 1 and self.resizes:
                return size, plan.drafter_depth[-1]
        return size, plan.drafter_depth[size - 1]

    @property
    def resizes(self) -> bool:
        """Whether a lone sequence's tree size is chosen again from its draft's own tree (greedy
        proposals, whose confidence tells each step's expected tokens; `propose_tree`)."""
        return self.tree is not None and self.greedy_proposals

    def propose_tree(self, drafted: Ranked | torch.Tensor, anchor: int, size: int, lookup: list[int], gen,
                     resize: bool = False, choose: Chooser | None = None, position: int = 0) -> Proposal:
        """A tree of `size` nodes (and a lookup branch) from the drafter's best token ids and their
        probabilities [D, WIDTH] (greedy proposals), shaped by its confidence in each, or from its
        logits [D, V] (sampled proposals). `resize` (a lone sequence's adaptive size, `resizes`):
        the size is chosen again from this draft's own tree, whose expected tokens its confidence
        tells (the plan before the draft knew only the average tree's, by ranks). Coupled: the
        candidates are the best perturbed scores of each position (its logits [D, V], the noise of
        positions position + 1 .. + D), with the drafter's probability of each, as greedy ones."""
        if self.coupled:
            drafted = Ranked(*choose.best(drafted, list(range(position + 1, position + 1 + drafted.shape[0])), WIDTH))
        if self.greedy_proposals:
            resize = resize and self.resizes
            tree = build_tree(drafted.ids.tolist(), anchor, self.tree_budget if resize else size, self.rates, lookup,
                              confidence=drafted.probs.tolist())
            if resize:
                tree = truncate(tree, self.tree.best_size(list(itertools.accumulate(tree.values)), size))
        else:
            q = probs_from_logits(drafted, self.sampling)  # [D, V]
            cands = draft_candidates(q, WIDTH, True, gen)
            tree = build_tree(cands, anchor, size, self.rates, lookup, merge=False, q=q)
        return Proposal(tree, "tree", self.tree, ran_draft=True)


@dataclass
class DraftWanted:
    """A sequence whose proposal waits for the drafter's logits of a block: the drafter runs once
    for every sequence of a step that drafts (`draft_blocks`)."""

    seq: object  # engine.Sequence
    block: int
    finish: Callable[[torch.Tensor], Proposal]  # the proposal from the drafter's output for the block
    top: int = 0  # that output: the ids of its `top` best tokens per position [block - 1, top] (0: its logits [block - 1, V])
    ranked: bool = False  # ... with the drafter's probability of each (`Ranked`; a greedy tree's candidates)


def draft_blocks(wanted: list[DraftWanted], target, draft) -> list[torch.Tensor]:
    """The drafter's output for every sequence that wants a block (its logits [block - 1, V], or
    its best token ids [block - 1, top], `Ranked` with their probabilities where `ranked`): one
    draft forward for all that want the same block size (a lone sequence runs the single-sequence
    forward, the reference's numerics; its best ids come without the full vocabulary's logits,
    `DraftModel.block_top`)."""
    head = draft.head_for(target.lm_head)
    outputs: list[torch.Tensor | None] = [None] * len(wanted)
    by_block: dict[int, list[int]] = {}
    for i, w in enumerate(wanted):
        by_block.setdefault(w.block, []).append(i)
    for block, group in by_block.items():
        seqs = [wanted[i].seq for i in group]
        if len(seqs) == 1:
            w = wanted[group[0]]
            s = w.seq
            args = (target.embed_tokens, head, s.draft_cache, torch.cat(s.pending_taps, dim=1), s.anchor, s.position,
                    block)
            if not w.top:
                outputs[group[0]] = draft.block_logits(*args)
            else:
                outputs[group[0]] = (draft.block_ranked if w.ranked else draft.block_top)(*args, w.top)
            continue
        logits = head(draft.blocks_hidden(target.embed_tokens, [s.draft_cache for s in seqs],
                                          [torch.cat(s.pending_taps, dim=1) for s in seqs],
                                          [s.anchor for s in seqs], [s.position for s in seqs], block))
        for row, i in enumerate(group):  # logits: [B_block, block - 1, V]
            w = wanted[i]
            if not w.top:
                outputs[i] = logits[row]
            else:
                outputs[i] = ranked(logits[row], w.top) if w.ranked else top_ids(logits[row], w.top)
    return outputs
