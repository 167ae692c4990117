"""An oracle drafter: proposes the target's own greedy continuation (computed beforehand), each
token kept with probability `keep` (else replaced by a wrong one, which ends a chain's acceptance
there; the true token then ranks second, as a token tree's second candidate).

It runs the real draft forward first, so a step costs what a real drafter's step costs; only the
proposed tokens differ. With it the engine's speed can be measured against a controlled tau,
independently of how well a drafter is trained, and tests get partial, full and zero acceptance.
"""

from __future__ import annotations

import torch

from ..models.draft import DraftModel
from ..models.vocab import Ranked, top_ids
from .verify import verify_greedy


class OracleDraft(DraftModel):
    def __init__(self, base: DraftModel, continuation: list[int], prompt_len: int, keep: float, seed: int = 0):
        super().__init__(base.cfg)
        self.load_state_dict(base.state_dict())
        self.to(next(base.parameters()).device)
        self.vocab_ids = base.vocab_ids  # the same head cost as the drafter it stands in for
        self.continuation = continuation  # the target's greedy tokens after the prompt
        self.prompt_len = prompt_len
        self.keep = keep
        self.gen = torch.Generator().manual_seed(seed)

    def block_logits(self, embed, lm_head, cache, context_taps, anchor, position, block):
        logits = super().block_logits(embed, lm_head, cache, context_taps, anchor, position, block)
        return self.proposal_logits(position, block, logits)

    def proposal_logits(self, position: int, block: int, logits: torch.Tensor) -> torch.Tensor:
        """Its logits [block-1, V] for the block whose anchor is at `position`, in place of the
        drafter's `logits` (whose shape, dtype and device they take)."""
        vocab = logits.shape[-1]
        out = torch.full_like(logits, -1e4)  # [block-1, V]
        for k in range(block - 1):
            idx = position + 1 + k - self.prompt_len  # index of the token at position+1+k
            truth = self.continuation[idx] if 0 <= idx < len(self.continuation) else 0
            right = torch.rand((), generator=self.gen).item() < self.keep
            out[k, truth if right else (truth + 1) % vocab] = 0.0
            if not right:  # the truth ranks second, where a token tree (tree.py) may still find it
                out[k, truth] = -1.0
        return out

    def block_top(self, embed, lm_head, cache, context_taps, anchor, position, block, k):
        return top_ids(self.block_logits(embed, lm_head, cache, context_taps, anchor, position, block), k)

    def block_ranked(self, embed, lm_head, cache, context_taps, anchor, position, block, k):
        """Its candidates with a confidence that carries no news of which is right (its logits
        would: the truth is sure when kept): `keep` for the first, the rest shared by the others,
        the same at every step, so a tree of it is shaped as by ranks alone."""
        ids = self.block_top(embed, lm_head, cache, context_taps, anchor, position, block, k)  # [block-1, k]
        probs = torch.full(ids.shape, (1 - self.keep) / max(1, ids.shape[-1] - 1))
        probs[:, 0] = self.keep
        return Ranked(ids, probs)

    def matching_prefix(self, embed, lm_head, cache, context_taps, anchor, position, block, truth):
        """Its own proposals, not the LM head's: the whole block, then the greedy verdict."""
        proposals = self.block_logits(embed, lm_head, cache, context_taps, anchor, position, block).argmax(-1)
        n = min(len(truth), block - 1)
        return verify_greedy(proposals[:n], torch.tensor(truth[:n] + [0], device=proposals.device)).num_accepted
