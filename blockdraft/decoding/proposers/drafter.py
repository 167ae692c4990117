"""The drafter's one forward per step for every sequence that drafts."""

from __future__ import annotations

import torch

from ...models.vocab import ranked, top_ids
from .proposal import DraftWanted


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
