"""Sampling must preserve the target's distribution: statistical tests, not exact match.

The statistic is Pearson's chi-square against the exact law (cells expected fewer than 5 times
pooled into one), at a false-alarm rate of 10^-6: seeds are fixed, so a test passes or fails the
same way every run, and a correct sampler fails one seed in a million. A test over several
statistics (`battery`) splits that rate between them (Bonferroni). The power against a given
wrong law is that of the noncentral chi-square (`battery_power`); test_sampling_power.py runs the
tests with power (10^5 draws, depth-3 blocks, trees, top-k/top-p, batches) and their negative
controls."""

import math

import pytest
import torch

from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.decoding.verify import SamplingParams, probs_from_logits, verify_sampled

from conftest import tiny_draft, tiny_target

ALPHA = 1e-6  # false alarms per test
MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled (the chi-square approximation needs ~5)


def total_variation(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def chi2_sf(x: float, df: int) -> float:
    """P(chi-square(df) > x): the regularised upper incomplete gamma function (no scipy)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """The x with P(chi-square(df) > x) = alpha, by bisection."""
    lo, hi = 0.0, df + 40 * math.sqrt(2 * df) + 200
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def ncx2_sf(x: float, df: int, lam: float) -> float:
    """P(noncentral chi-square(df, lam) > x): a Poisson(lam / 2) mixture of central ones."""
    h = lam / 2
    j = torch.arange(int(h + 20 * math.sqrt(h + 1) + 50), dtype=torch.float64)
    weights = torch.exp(-h + j * math.log(h) - torch.lgamma(j + 1)) if h > 0 else (j == 0).double()
    return float((weights * torch.special.gammaincc(df / 2 + j, torch.tensor(x / 2, dtype=torch.float64))).sum())


def _cells(law: torch.Tensor, n: float) -> torch.Tensor:
    """Which cells (of a flattened law) the statistic pools into one: those expected fewer than
    `MIN_EXPECTED` times, and more of the least likely until the pool itself is expected that
    often (a pooled cell expected 0.1 times would make a single draw there a false alarm).
    Cells of probability 0 stay apart: one draw there is a rejection by itself."""
    expected = law * n
    possible = (law > 0).nonzero()[:, 0]
    order = possible[expected[possible].argsort()]
    k = int((expected[order] < MIN_EXPECTED).sum())
    while 0 < k < len(order) and float(expected[order[:k]].sum()) < MIN_EXPECTED:
        k += 1
    pool = torch.zeros_like(law, dtype=torch.bool)
    pool[order[:k]] = True
    return pool


def _pooled(values: torch.Tensor, law: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    live = (law > 0) & ~pool
    return torch.cat([values[live], values[pool].sum().reshape(1)]) if pool.any() else values[live]


def chi_square(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts against the exact law (same shape), and its degrees of
    freedom (infinite where a draw fell on a token of probability 0)."""
    law, counts = law.double().flatten(), counts.double().flatten()
    n = float(counts.sum())
    pool = _cells(law, n)
    observed, expected = _pooled(counts, law, pool), _pooled(law * n, law, pool)
    stat = float(((observed - expected) ** 2 / expected).sum())
    return (math.inf if counts[law == 0].any() else stat), len(expected) - 1


def noncentrality(alternative: torch.Tensor, law: torch.Tensor, n: int) -> tuple[float, int]:
    """lambda = n * sum (pi1 - pi0)^2 / pi0 over `chi_square`'s cells: what n draws of a sampler
    of law `alternative` add to the statistic's mean (and its degrees of freedom)."""
    law, alternative = law.double().flatten(), alternative.double().flatten()
    if float(alternative[law == 0].sum()) > 0:  # it draws tokens of probability 0
        return math.inf, len(law) - 1
    pool = _cells(law, n)
    a, z = _pooled(alternative, law, pool), _pooled(law, law, pool)
    return float(n * ((a - z) ** 2 / z).sum()), len(z) - 1


def margins(k: int) -> list[tuple[int, ...]]:
    """The battery's statistics over k tokens: each token alone (a bias at one depth that moves
    mass the same way in every context shows there with few degrees of freedom), each two in a
    row, and all k together (any bias)."""
    return [(i,) for i in range(k)] + [(i, i + 1) for i in range(k - 1)] + ([tuple(range(k))] if k > 2 else [])


def _margin(table: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    rest = tuple(i for i in range(table.dim()) if i not in axes)
    return table.sum(rest) if rest else table


def battery(counts: torch.Tensor, law: torch.Tensor, alpha: float = ALPHA) -> list[tuple[tuple, float, float]]:
    """counts and law [V] * k (the first k committed tokens): per statistic of `margins(k)`, (its
    tokens, statistic, critical value at alpha split between them). The law is rejected when any
    statistic passes its critical value."""
    out = []
    for axes in margins(law.dim()):
        stat, df = chi_square(_margin(counts, axes), _margin(law, axes))
        out.append((axes, stat, chi2_critical(df, alpha / len(margins(law.dim())))))
    return out


def rejected(results) -> bool:
    return any(stat > crit for _, stat, crit in results)


def battery_power(alternative: torch.Tensor, law: torch.Tensor, n: int, alpha: float = ALPHA) -> float:
    """A lower bound on the battery's power against a sampler of law `alternative` with n draws:
    the best of its statistics' powers (it rejects when any of them does)."""
    impossible = float(alternative.double()[law == 0].sum())  # one draw there rejects by itself
    best = 1 - (1 - impossible) ** n
    for axes in margins(law.dim()):
        lam, df = noncentrality(_margin(alternative, axes), _margin(law, axes), n)
        if math.isfinite(lam):
            best = max(best, ncx2_sf(chi2_critical(df, alpha / len(margins(law.dim()))), df, lam))
    return best


def first_tokens(p: torch.Tensor, q: torch.Tensor, greedy_proposals: bool, draws: int,
                 told: torch.Tensor | None = None) -> torch.Tensor:
    """Counts [V] of the first committed token of `draws` verdicts of blocks drafted from q (or
    its argmaxes); `told`: the q the verifier is given instead (a negative control)."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(p.shape[-1])
    for _ in range(draws):
        if greedy_proposals:
            d = q.argmax(-1)
            v = verify_sampled(d, p, None, gen)
        else:
            d = torch.multinomial(q, 1, generator=gen)[:, 0]
            v = verify_sampled(d, p, q if told is None else told, gen)
        counts[d[0].item() if v.num_accepted >= 1 else v.next_token] += 1
    return counts


def _p_and_q():
    torch.manual_seed(0)
    return torch.softmax(torch.randn(4, 6) * 1.5, -1), torch.softmax(torch.randn(3, 6) * 1.5, -1)


@pytest.mark.parametrize("greedy_proposals", [False, True])
def test_first_committed_token_follows_p(greedy_proposals):
    """Whatever q is, the first committed token is distributed as p_0 (accepted d_1 or recovered):
    20000 draws, the chi-square at alpha 10^-6 (test_sampling_power.py has 10^5 draws, depth 3,
    trees and filters)."""
    p, q = _p_and_q()
    stat, df = chi_square(first_tokens(p, q, greedy_proposals, 20000), p[0])
    assert stat < chi2_critical(df)


def test_the_first_token_test_rejects_a_verifier_told_the_wrong_q():
    """The test above can fail: a verifier told q_1 at a temperature 10% off (the drafts drawn
    from the true q_1) commits a first token whose law is off by TV ~0.02, which 20000 draws reject
    with power > 0.99 (the noncentrality of that exact law, asserted)."""
    p, q = _p_and_q()
    told = q.clone()
    told[0] = q[0] ** (1 / 1.1) / (q[0] ** (1 / 1.1)).sum()
    accepted = q[0] * (p[0] / told[0]).clamp(max=1)  # the rule: accept d with min(1, p/q'), ...
    rest = (p[0] - told[0]).clamp_min(0)  # ... else draw from normalize(max(0, p - q'))
    law = accepted + (1 - accepted.sum()) * rest / rest.sum()
    assert 0.015 < 0.5 * float((law - p[0]).abs().sum()) < 0.03
    lam, df = noncentrality(law, p[0], 20000)
    assert ncx2_sf(chi2_critical(df), df, lam) > 0.99
    stat, df = chi_square(first_tokens(p, q, False, 20000, told), p[0])
    assert stat > chi2_critical(df)


def test_top_k_top_p_restrict_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0, 0] == 1.0  # the first token alone has mass >= 0.5


@pytest.mark.parametrize("coupling,proposal,subset,draft_dtype,tree", [
    ("rejection", "sample", None, None, None), ("rejection", "greedy", None, None, None),
    ("rejection", "sample", [0, 2, 5, 6], None, None), ("rejection", "sample", None, torch.bfloat16, None),
    ("rejection", "sample", None, None, 6), ("rejection", "greedy", None, None, 6),
    ("gumbel", "sample", None, None, None), ("gumbel", "sample", [0, 2, 5, 6], None, None),
    ("gumbel", "sample", None, torch.bfloat16, 6)])
def test_engine_sampling_matches_exact_two_token_distribution(coupling, proposal, subset, draft_dtype, tree):
    """Speculative sampling's joint distribution of the first two new tokens equals the target's,
    computed exactly by enumeration (tiny vocabulary, temperature 1.5, top-k 5); also with a
    draft vocabulary subset (vocab.py), where q is zero outside the subset, with the drafter
    in bf16 beside an fp32 target (q is whatever the bf16 drafter computed), and with token
    trees of 6 nodes (tree.py) of sampled and of argmax candidates; by rejection sampling and by
    the Gumbel coupling (gumbel.py; test_gumbel.py: its text equals plain sampling's)."""
    target = tiny_target("llama", vocab=8, layers=3)
    draft = tiny_draft(target, block_size=4)
    if subset is not None:
        draft.vocab_ids = torch.tensor(subset)
    params = dict(temperature=1.5, top_k=5)
    prompt = [1, 2, 3]
    sp = SamplingParams(**params)
    with torch.inference_mode():
        p1 = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1], sp)
        exact = torch.zeros(8, 8)
        for a in range(8):
            if p1[a] > 0:
                p2 = probs_from_logits(target.model(torch.tensor([prompt + [a]])).logits[0, -1], sp)
                exact[a] = p1[a] * p2
    engine = Engine(target, draft, draft_dtype=draft_dtype)
    counts = torch.zeros(8, 8)
    runs = 3000
    for seed in range(runs):
        cfg = GenerationConfig(max_new_tokens=2, stop_token_ids=(), proposal=proposal, tree_budget=tree, coupling=coupling,
                               block_size=4 if tree else None, sampling=SamplingParams(**params, seed=seed))
        a, b = engine.generate(prompt, cfg).token_ids
        counts[a, b] += 1
    # the chi-square at alpha 10^-6 on 3000 draws over <= 25 outcomes: it rejects any law of the
    # two tokens off by TV 0.09 with power > 0.99, whatever its shape; the tests with power (10^5
    # draws, depth 3) are test_sampling_power.py's
    assert power_at_tv(exact, runs, 0.09) > 0.99
    assert not rejected(battery(counts, exact))


def test_seed_makes_sampling_reproducible():
    target = tiny_target("qwen3")
    engine = Engine(target, tiny_draft(target))
    cfg = GenerationConfig(max_new_tokens=20, stop_token_ids=(), sampling=SamplingParams(1.0, 0, 0.9, seed=7))
    assert engine.generate([4, 5, 6], cfg).token_ids == engine.generate([4, 5, 6], cfg).token_ids


def power_at_tv(law: torch.Tensor, n: int, tv: float, alpha: float = ALPHA) -> float:
    """A lower bound on the battery's power with n draws against any law, whatever its shape, off
    by a total variation of at least `tv` from `law` over the joint statistic's cells: by
    Cauchy-Schwarz its chi-square divergence is at least 4 tv^2, so lambda >= 4 n tv^2."""
    _, df = noncentrality(law, law, n)
    return ncx2_sf(chi2_critical(df, alpha / len(margins(law.dim()))), df, 4 * n * tv * tv)
