"""Randomness tied to positions: the Gumbel-max coupling of target and drafter (issue 51).

Sampling token t from p is choosing argmax_v (log p(v) + g_v) with g_v independent standard
Gumbel noise (the Gumbel-max trick: an exact draw from p). Here the noise of the token at absolute
position t of a request is drawn from a counter-based key (the request's seed, t): the same noise
whenever and however often position t is looked at. Hence:

- The text of a seeded request depends only on its seed and its context, never on the schedule:
  the target's logits at position t are those of the tokens before it (the engine's kernels give a
  row the same logits at every block size, tree and batch), so its token there is fixed whatever
  block sizes, trees, prompt lookups or batch neighbours the steps had. It equals plain sampling
  with the same seed token for token, and the adaptive policies may follow timings at T > 0 too.
- The drafter proposes argmax_v (log q(v) + g_v) with the noise of the same position (a tree: the
  WIDTH best of those perturbed scores). Where q is close to p the two argmaxes agree; verification
  is an equality test, a draft accepted iff it is the target's own token there, exactly as greedy
  verification is (verify.py's `verify_greedy`, tree.py's `verify_tree_greedy`), with no draft
  distribution to compute and no rejection draws. The committed tokens are the target's samples
  whatever the drafter proposed, so the law is the target's exactly.

Against rejection sampling (verify.py's `verify_sampled`, `--coupling rejection`): rejection
sampling accepts a draft drawn from q with probability sum_v min(p, q), the most any coupling of
one draft can; the Gumbel coupling accepts a little less per position (docs/sampling.md measures
both), but needs no q, keeps the text fixed by the seed, and makes trees at T > 0 as cheap as
greedy ones.

The noise: numpy's Philox, a counter-based generator (what torch's CPU generator is not), keyed
by the seed with its counter starting at the position, gives fp32 uniforms, turned into Gumbel
noise (a uniform of 0 gives -inf: a token never chosen, probability 2^-24 each). Generated on the
CPU whatever the device, so that a seed gives the same text on every device whose logits agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .verify import SamplingParams, probs_from_logits

KEEP = 64  # positions of noise a request keeps (the block being verified and the next ones)


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [V] fp32 for one position (CPU). The position is the counter's top
    word: one position's draws count up from it in the low words, never reaching the next's."""
    gen = np.random.Generator(np.random.Philox(key=seed, counter=[0, 0, 0, position]))
    u = torch.from_numpy(gen.random(vocab, dtype=np.float32))
    return u.log_().neg_().log_().neg_()  # -log(-log(u))


@dataclass
class PositionNoise:
    """One request's noise by absolute position, made once per position and kept while the
    request may still read it (positions behind the committed ones are dropped)."""

    seed: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    made: dict[int, torch.Tensor] = field(default_factory=dict)

    def rows(self, positions: list[int], vocab: int) -> torch.Tensor:
        """The noise of these positions over a vocabulary of `vocab` [n, V] on the request's device."""
        for t in positions:
            if t not in self.made or self.made[t].shape[0] != vocab:
                self.made[t] = gumbel_noise(self.seed, t, vocab).to(self.device)
        rows = torch.stack([self.made[t] for t in positions])
        if len(self.made) > KEEP:  # the earliest positions are committed: not read again (else made again)
            for t in sorted(self.made)[: len(self.made) - KEEP]:
                del self.made[t]
        return rows


def perturbed(logits: torch.Tensor, noise: torch.Tensor, params: SamplingParams,
              probs: torch.Tensor | None = None) -> torch.Tensor:
    """logits / T + g on the support top-k and top-p leave (-inf elsewhere) [n, V]: its argmax is
    an exact draw from `probs_from_logits(logits, params)` (log of those probabilities is
    logits / T less one constant per row on the support). `probs`: those probabilities where the
    caller has them already."""
    scores = logits.float() / params.temperature
    if params.top_k or params.top_p < 1.0:
        probs = probs_from_logits(logits, params) if probs is None else probs
        scores = scores.masked_fill(probs == 0, float("-inf"))
    return scores + noise


@dataclass
class Chooser:
    """A request's own token at a position from the target's logits there: the argmax (greedy), or
    with the Gumbel coupling the argmax of the logits perturbed by that position's noise; None
    (`pick` refuses) for rejection sampling, whose draws are not a function of the position."""

    params: SamplingParams
    noise: PositionNoise | None = None

    @property
    def deterministic(self) -> bool:
        """Whether a position's token is a function of its logits (greedy or coupled): verdicts
        are then equality tests."""
        return self.params.greedy or self.noise is not None

    def pick(self, logits: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The token at each position from its logits row [n, V] -> [n]."""
        if self.params.greedy:
            return logits.argmax(-1)
        assert self.noise is not None, "rejection sampling draws from the request's generator"
        return perturbed(logits, self.noise.rows(positions, logits.shape[-1]), self.params).argmax(-1)

    def best(self, logits: torch.Tensor, positions: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A drafter's `k` best proposals of each position [n, k] by the same perturbed scores (its
        first: its coupled sample), and its probability of each [n, k] (a tree's confidence)."""
        probs = probs_from_logits(logits, self.params)  # [n, V]: the confidence, and the filters' support
        scores = perturbed(logits, self.noise.rows(positions, logits.shape[-1]), self.params, probs)
        ids = scores.topk(min(k, scores.shape[-1]), dim=-1).indices
        return ids, probs.gather(-1, ids)
