"""Lossless verification of a drafted block: pure tensor code, no model access.

Names follow the speculative-decoding papers: p is the target's distribution, q the draft's.
A step proposes n draft tokens d_1..d_n; the target scored the block [anchor, d_1..d_n], giving
n + 1 rows of p (row k predicts the token after position k). The verdict is how many drafts are
accepted and the one extra token that always commits: the **bonus** token (all accepted, drawn
from p at the last row) or the **recovered** token (drawn at the first rejection).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..errors import BlockdraftError


MIN_TEMPERATURE = 1e-5  # temperatures below this decode greedily


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        # below MIN_TEMPERATURE, logits / T overflow fp32 (1e-40 gave inf, then NaN probabilities);
        # the distribution there is the argmax's anyway, so such a temperature decodes greedily (as vLLM's)
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> "SamplingParams":
        t, k, p = self.temperature, self.top_k, self.top_p
        if not (isinstance(t, (int, float)) and math.isfinite(t) and 0 <= t <= 100):
            raise BlockdraftError(f"temperature must be in [0, 100] (got {t})")
        if not (isinstance(k, int) and k >= 0):
            raise BlockdraftError(f"top_k must be a non-negative integer (got {k})")
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise BlockdraftError(f"top_p must be in (0, 1] (got {p})")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise BlockdraftError(f"seed must be a non-negative 64-bit integer (got {self.seed})")
        return self


@dataclass
class Verdict:
    num_accepted: int  # accepted draft tokens, 0..n
    next_token: int  # bonus (all accepted) or recovered (first rejection) token

    @property
    def acceptance_length(self) -> int:
        """Tokens this step commits beyond the anchor: accepted drafts + the bonus/recovered one."""
        return self.num_accepted + 1


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution actually sampled from: softmax(logits / T) restricted by top-k, top-p."""
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


RowSource = Callable[[int, int], torch.Tensor]  # (start, stop) -> rows start..stop-1 of a [n + 1, ...] tensor
FIRST_CHUNK = 2  # rows of the first lazy chunk; each next chunk doubles (see `row_chunks`)


def row_chunks(rows: int, first: int = FIRST_CHUNK) -> Iterator[tuple[int, int]]:
    """(start, stop) of chunks covering rows 0..rows-1: first, 2*first, 4*first, ... rows. Most
    blocks are rejected in the first chunk; a fully accepted block pays a few more head calls."""
    start, size = 0, max(1, first)
    while start < rows:
        yield start, min(rows, start + size)
        start, size = start + size, 2 * size


def row_reader(source: RowSource, rows: int, first: int = FIRST_CHUNK) -> Callable[[int], torch.Tensor]:
    """Row i of a lazy source, read in the chunks of `row_chunks` (each chunk once), for verdicts
    that visit rows out of order (a tree's walk)."""
    bounds = list(row_chunks(rows, first))
    loaded: dict[int, torch.Tensor] = {}

    def row(i: int) -> torch.Tensor:
        k = next(k for k, (a, b) in enumerate(bounds) if a <= i < b)
        if k not in loaded:
            loaded[k] = source(*bounds[k])
        return loaded[k][i - bounds[k][0]]

    return row


def _read(source: torch.Tensor | RowSource, rows: int, first_chunk: int | None):
    """A row source and the chunks to read it in: a tensor whole (one chunk), a callable lazily."""
    if callable(source):
        return source, row_chunks(rows, first_chunk or FIRST_CHUNK)
    return (lambda a, b: source[a:b]), row_chunks(rows, first_chunk or rows)


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor | RowSource,
                  first_chunk: int | None = None) -> Verdict:
    """T = 0. draft_tokens [n]; target_argmax [n + 1] (or a source of its rows, read lazily in
    chunks up to the first disagreement): accept while d_k == argmax p_{k-1}."""
    n = draft_tokens.shape[0]
    argmax_rows, chunks = _read(target_argmax, n + 1, first_chunk)
    for start, stop in chunks:
        am = argmax_rows(start, stop)  # [stop - start]
        m = min(stop, n) - start  # drafts judged by these rows
        agree = (draft_tokens[start:start + m] == am[:m]).int()
        run = int(agree.cumprod(0).sum()) if m else 0  # a host sync per chunk
        if run < m or stop == n + 1:  # a disagreement, or the bonus row is in this chunk
            return Verdict(start + run, int(am[run]))
    raise AssertionError("unreachable: the last chunk holds the bonus row")


def verify_sampled(
    draft_tokens: torch.Tensor,  # [n]
    p: torch.Tensor | RowSource,  # [n + 1, V] target probabilities, or a source of its rows (lazy)
    q: torch.Tensor | None,  # [n, V] the draft distribution d_k was drawn from; None = greedy proposals
    generator: torch.Generator | None = None,
    first_chunk: int | None = None,
) -> Verdict:
    """T > 0 rejection sampling (Leviathan et al.): accept d_k with prob min(1, p(d_k) / q(d_k)),
    on the first rejection draw from normalize(max(0, p - q)), else draw the bonus from p_n.
    With q = None the proposals were argmaxes (q one-hot), so acceptance is p(d_k). A lazy `p`
    is read in chunks up to the first rejection; the draws are the same either way."""
    n = draft_tokens.shape[0]
    p_rows, chunks = _read(p, n + 1, first_chunk)
    device = draft_tokens.device
    u = torch.rand(n, generator=generator, device=device)  # all n uniforms first, as the eager rule
    idx = draft_tokens[:, None]
    q_d = torch.ones(n, device=device) if q is None else q.gather(-1, idx)[:, 0]
    for start, stop in chunks:
        chunk = p_rows(start, stop)  # [stop - start, V]
        m = min(stop, n) - start
        p_d = chunk[:m].gather(-1, idx[start:start + m])[:, 0]
        run = int((u[start:start + m] * q_d[start:start + m] < p_d).int().cumprod(0).sum()) if m else 0
        if run == m and stop < n + 1:
            continue
        accepted = start + run
        row = chunk[run]
        if accepted == n:
            return Verdict(n, int(sample(row, generator)))
        if q is None:
            residual = row.clone()
            residual[draft_tokens[accepted]] = 0
        else:
            residual = (row - q[accepted]).clamp_min(0)
        total = residual.sum()
        # total == 0 only when p == q on this row, where a rejection has probability 0
        residual = residual / total if total > 0 else row
        return Verdict(accepted, int(sample(residual, generator)))
    raise AssertionError("unreachable: the last chunk holds the bonus row")
