"""Lossless verification of a draft: pure tensor code, no model access. One verifier, `verify`,
for every shape a step proposes (tree.py's `Tree`: a chain is the tree whose parents are i - 1, a
plain step the root alone); a chain is its fast case, read in chunks and compared at once.

Names follow the speculative-decoding papers: p is the target's distribution, q the draft's.
A step proposes n draft tokens d_1..d_n; the target scored the block [anchor, d_1..d_n], giving
n + 1 rows of p (row k predicts the token after position k; a tree's row i, the token after node
i). The verdict is the accepted path and the one extra token that always commits: the **bonus**
token (all accepted, drawn from p at the last row) or the **recovered** token (drawn at the first
rejection). Acceptance length: accepted drafts + 1; tau, its mean over steps.

- T = 0, or T > 0 with the Gumbel coupling (gumbel.py): the target's token at each position is a
  function of its row, so a draft is accepted iff it equals it (`verify_greedy`, `verify_tree_greedy`).
- T > 0 with rejection sampling: Leviathan et al.'s rule on a chain (`verify_sampled`), SpecInfer's
  multi-candidate rule at each node of a tree (`verify_tree_sampled`; tree.py's docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import torch

from ..errors import BlockdraftError
from .tree import LOOKUP, Tree


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
    path: list[int]  # accepted nodes, the root (the anchor) first: a chain's are 0..accepted
    next_token: int  # bonus (all accepted) or recovered (first rejection) token

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens, 0..n."""
        return len(self.path) - 1

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


def _chain(accepted: int, token: int) -> Verdict:
    return Verdict(list(range(accepted + 1)), token)


def verify_greedy(draft_tokens: torch.Tensor | Sequence[int], target_argmax: torch.Tensor | RowSource,
                  first_chunk: int | None = None) -> Verdict:
    """T = 0. draft_tokens [n]; target_argmax [n + 1] (or a source of its rows, read lazily in
    chunks up to the first disagreement): accept while d_k == argmax p_{k-1}."""
    drafts = draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else list(draft_tokens)
    n = len(drafts)
    argmax_rows, chunks = _read(target_argmax, n + 1, first_chunk)
    for start, stop in chunks:
        am = argmax_rows(start, stop).tolist()  # [stop - start]: a host sync per chunk
        m = min(stop, n) - start  # drafts judged by these rows
        run = next((k for k in range(m) if drafts[start + k] != am[k]), m)
        if run < m or stop == n + 1:  # a disagreement, or the bonus row is in this chunk
            return _chain(start + run, am[run])
    raise AssertionError("unreachable: the last chunk holds the bonus row")


def verify_sampled(
    draft_tokens: torch.Tensor | Sequence[int],  # [n]
    p: torch.Tensor | RowSource,  # [n + 1, V] target probabilities, or a source of its rows (lazy)
    q: torch.Tensor | None,  # [n, V] the draft distribution d_k was drawn from; None = greedy proposals
    generator: torch.Generator | None = None,
    first_chunk: int | None = None,
) -> Verdict:
    """T > 0 rejection sampling (Leviathan et al.): accept d_k with prob min(1, p(d_k) / q(d_k)),
    on the first rejection draw from normalize(max(0, p - q)), else draw the bonus from p_n.
    With q = None the proposals were argmaxes (q one-hot), so acceptance is p(d_k). A lazy `p`
    is read in chunks up to the first rejection; the draws are the same either way."""
    p_rows, chunks = _read(p, len(draft_tokens) + 1, first_chunk)
    u = idx = q_d = None
    for start, stop in chunks:
        chunk = p_rows(start, stop)  # [stop - start, V]
        if u is None:  # all n uniforms first, as the eager rule, on the rows' device
            draft_tokens = torch.as_tensor(draft_tokens, dtype=torch.long, device=chunk.device)
            n = draft_tokens.shape[0]
            u = torch.rand(n, generator=generator, device=chunk.device)
            idx = draft_tokens[:, None]  # [n, 1]
            q_d = torch.ones(n, device=chunk.device) if q is None else q.gather(-1, idx)[:, 0]
        m = min(stop, n) - start
        p_d = chunk[:m].gather(-1, idx[start:start + m])[:, 0]
        run = int((u[start:start + m] * q_d[start:start + m] < p_d).int().cumprod(0).sum()) if m else 0
        if run == m and stop < n + 1:
            continue
        accepted = start + run
        row = chunk[run]
        if accepted == n:
            return _chain(n, int(sample(row, generator)))
        if q is None:
            residual = row.clone()
            residual[draft_tokens[accepted]] = 0
        else:
            residual = (row - q[accepted]).clamp_min(0)
        total = residual.sum()
        # total == 0 only when p == q on this row, where a rejection has probability 0
        residual = residual / total if total > 0 else row
        return _chain(accepted, int(sample(residual, generator)))
    raise AssertionError("unreachable: the last chunk holds the bonus row")


def verify_tree_greedy(tree: Tree, argmax_at: Callable[[int], int]) -> Verdict:
    """Walk from the root while a child holds the target's argmax at its parent. `argmax_at(i)`:
    the target's greedy token after node i (one row of its logits; read only along the walk)."""
    path = [0]
    while True:
        want = int(argmax_at(path[-1]))
        child = next((c for c in tree.children(path[-1]) if tree.tokens[c] == want), None)
        if child is None:
            return Verdict(path, want)
        path.append(child)


def _proposal(tree: Tree, child: int) -> torch.Tensor | None:
    """The distribution [V] child's token was drawn from: q_d without the draws ranked before it
    (renormalised); None for a deterministic candidate (q one-hot)."""
    if tree.q is None or tree.ranks[child] == LOOKUP:
        return None
    d, r = tree.depths[child], tree.ranks[child]
    q = tree.q[d - 1].clone()
    if r:
        q[torch.tensor(tree.candidates[d - 1][:r], device=q.device)] = 0
    return q / q.sum()


def verify_tree_sampled(tree: Tree, p_at: Callable[[int], torch.Tensor],
                        generator: torch.Generator | None = None) -> Verdict:
    """T > 0: multi-candidate rejection sampling at each node of the walk (see the module's
    docstring). `p_at(i)`: the target's distribution [V] after node i."""
    path = [0]
    while True:
        p = p_at(path[-1]).clone()
        accepted = None
        for c in tree.children(path[-1]):
            x, q = tree.tokens[c], _proposal(tree, c)
            q_x = 1.0 if q is None else float(q[x])
            if float(torch.rand((), generator=generator, device=p.device)) * q_x < float(p[x]):
                accepted = c
                break
            if q is None:
                p[x] = 0
            else:
                p = (p - q).clamp_min(0)
            total = p.sum()
            # total 0 only if p equalled q, where a rejection has probability 0
            p = p / total if total > 0 else p_at(path[-1])
        if accepted is None:
            return Verdict(path, int(sample(p, generator)))
        path.append(accepted)


class Chooses(Protocol):
    """A request's token at a position from the target's row there (gumbel.py's `Chooser`)."""

    params: SamplingParams

    @property
    def deterministic(self) -> bool:
        """Greedy or Gumbel-coupled: the token is a function of the row (verdicts are equality tests)."""

    def pick(self, logits: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Rows [n, V] at these positions -> their tokens [n]."""


def verify(draft: Tree, rows: RowSource, choose: Chooses, generator: torch.Generator | None = None,
           position: int = 0) -> Verdict:
    """The verdict on a draft (its root the anchor, at `position`) from the target's rows [N, V]
    over its nodes, read lazily (`rows(a, b)`: rows a..b-1, the LM head run on those alone).
    `choose`: the request's token at a position from its row (greedy or Gumbel-coupled: an
    equality test), else rejection sampling with `generator`. A chain (the parents i - 1, q for
    all its drafts or none) is the fast case: rows read in doubling chunks, compared at once."""
    after = position + 1  # node i's row predicts the token at position + 1 + depth(i)
    n = len(draft) - 1
    if draft.is_chain and (draft.q is None or not any(draft.ranks)):  # q by depth: rank-0 draws alone
        tokens = draft.tokens[1:]
        if choose.deterministic:
            return verify_greedy(tokens, lambda a, b: choose.pick(rows(a, b), list(range(after + a, after + b))))
        return verify_sampled(tokens, lambda a, b: probs_from_logits(rows(a, b), choose.params), draft.q, generator)
    row = row_reader(rows, n + 1)  # nodes are in order of value: the walk reads early rows
    if choose.deterministic:
        return verify_tree_greedy(draft, lambda i: choose.pick(row(i)[None], [after + draft.depths[i]])[0])
    return verify_tree_sampled(draft, lambda i: probs_from_logits(row(i), choose.params), generator)
