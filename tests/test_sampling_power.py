"""Sampling tests with power (issue 49): the committed tokens' joint law against the exact one,
with enough draws, deep enough blocks and calibrated negative controls that a biased sampler fails.

The statistic is test_sampling's `battery`: Pearson's chi-square of each token's law, of each two
in a row and of all together, against the exact law, at a false-alarm rate of 10^-6 in all (seeds
are fixed: a test passes or fails the same way every run).

1. The verification functions (verify.py's `verify_sampled`; tree.py's `draft_candidates`,
   `build_tree` and `verify_tree_sampled`, called as proposers/ and engine.py call them) on a toy
   target and drafter given as tables over V = 6 tokens: 10^5 draws per test, each drawn step
   after step until K = 3 tokens are committed, the target's rows read lazily as the engine reads
   them. Blocks have 3 drafts and trees 3 levels, so the third token comes from depth 3 when the
   first two are accepted (49-74% of the draws, by case). Cases: sampled drafts under top-k and top-p,
   argmax drafts at T > 0, trees of sampled candidates under top-k. The exact law of the first
   K tokens is the product of the target's tables. Whatever a wrong sampler's shape, a law of the
   3 tokens off by TV 0.02 is rejected with power > 0.99 (`power_at_tv`); the negative controls
   are subtler: a verifier told a draft law q' other than the q its drafts were drawn from (q at
   a temperature 11-18% off; for argmax drafts, one-hot mixed with q), at depth 1 only or at depth
   3 only, each off by TV 0.015 at its depth (`depth_tv`). Their exact laws come from `walk_law`,
   a model of the verification walk that must give the target's law for the true q (checked),
   whence each test's power against each control (> 0.99, asserted); each test runs both controls
   and must reject them.
2. The engine: that it hands the verifier, at every depth and in a batch whose rows sample
   differently, the target's exact rows for that row's context and filter and the q its drafts
   were drawn from (exactly, by spying on the verifier); and, end to end, the law of the first 4
   tokens of every row of such a batch (oracle drafters, chains and trees of depth 3), 800 draws
   a row, with a negative control at depth 3 and the power each states.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from blockdraft.decoding.engine import Engine, GenerationConfig, GenerationStats
from blockdraft.decoding.oracle import OracleDraft
from blockdraft.decoding.tree import WIDTH, Tree, TreeRates, build_tree, draft_candidates
from blockdraft.decoding.verify import verify_tree_sampled
from blockdraft.decoding.verify import SamplingParams, probs_from_logits, verify_sampled

from conftest import tiny_draft, tiny_target
from test_sampling import battery, battery_power, chi2_critical, ncx2_sf, power_at_tv, rejected

V = 6  # toy vocabulary
K = 3  # committed tokens whose joint law is tested
DEPTH = 3  # drafts per chain block, levels of a tree
DRAWS = 100_000
POWER = 0.99  # the least power each test must have against each negative control
PREFIXES = [c for n in range(K + DEPTH) for c in itertools.product(range(V), repeat=n)]
ROW = {c: i for i, c in enumerate(PREFIXES)}  # a prefix's row of the target's table
CONTEXTS = [c for c in PREFIXES if len(c) < K]  # where a step can start


# ---------------------------------------------------------------- the toy target and drafter

@dataclass
class Toy:
    """A target whose next-token law depends on the whole prefix, and a drafter that predicts
    every position of a block at once from the block's start (as DFlash does)."""

    params: SamplingParams
    p: torch.Tensor  # [len(PREFIXES), V] the target's law after each prefix (fp32, as the engine's rows)
    draft_logits: dict  # context -> [DEPTH, V]
    q: dict  # context -> [DEPTH, V] the draft law of each block position, filtered as the engine filters it

    def law(self) -> torch.Tensor:
        """The exact law [V] * K of the first K tokens: the product of the target's rows."""
        out = torch.ones([V] * K, dtype=torch.float64)
        for seq in itertools.product(range(V), repeat=K):
            out[seq] = math.prod(float(self.p[ROW[seq[:i]], seq[i]]) for i in range(K))
        return out

    def told(self, factor: float, depth: int) -> dict:
        """The q a biased verifier is told: at depth `depth`, the drafter's law at a temperature
        `factor` times the true one on the same support (q^(1 / factor), renormalised); the
        other depths right; in every block."""
        out = {}
        for c, q in self.q.items():
            q = q.clone()
            hot = q[depth - 1] ** (1 / factor)
            q[depth - 1] = hot / hot.sum()
            out[c] = q
        return out

    def told_argmax(self, eps: float, depth: int) -> dict:
        """For argmax proposals (q one-hot): the verifier told (1 - eps) one-hot + eps q at
        `depth` (one-hot, i.e. right, elsewhere)."""
        out = {}
        for c, q in self.q.items():
            one_hot = torch.nn.functional.one_hot(q.argmax(-1), V).float()
            one_hot[depth - 1] = (1 - eps) * one_hot[depth - 1] + eps * q[depth - 1]
            out[c] = one_hot
        return out


def toy(params: SamplingParams, seed: int = 0, sharp: float = 2.0, spread: float = 0.5, guess: float = 0.3) -> Toy:
    """The target's logits after a prefix: its position's (`sharp`) plus the prefix's own
    (`spread`); the drafter's for a block position: that position's plus noise of its own
    (`guess`), the same whatever the drafts before it. Each case picks these so that its first
    step reaches depth 3 often."""
    g = torch.Generator().manual_seed(seed)
    base = sharp * torch.randn(K + DEPTH, V, generator=g)
    target_logits = torch.stack([base[len(c)] + spread * torch.randn(V, generator=g) for c in PREFIXES])
    draft_logits = {c: base[len(c):len(c) + DEPTH] + guess * torch.randn(DEPTH, V, generator=g) for c in CONTEXTS}
    return Toy(params, probs_from_logits(target_logits, params), draft_logits,
               {c: probs_from_logits(lg, params) for c, lg in draft_logits.items()})


# ---------------------------------------------------------------- drivers: the library's functions, draw by draw

def _counts(seqs: list[tuple]) -> torch.Tensor:
    flat = torch.tensor([(a * V + b) * V + c for a, b, c in seqs])
    return torch.bincount(flat, minlength=V ** K).view([V] * K)


def chain_draws(t: Toy, n: int, seed: int, proposal: str, told: dict | None = None) -> torch.Tensor:
    """Counts [V] * K of the first K tokens of n runs of chain steps: each step drafts DEPTH
    tokens at the committed context (drawn from q, or its argmaxes), verifies them with
    `verify_sampled` (the target's rows read lazily, as engine.verify_proposal passes them), and
    commits the accepted drafts and the bonus or recovered token. `told`: the q the verifier is
    given instead of the true one (a negative control)."""
    gen = torch.Generator().manual_seed(seed)
    pools: dict = {}  # context -> [drafts [M, DEPTH], next, as lists]: q's draws, made in bulk
    argmaxes = {c: q.argmax(-1) for c, q in t.q.items()}
    out = []
    for _ in range(n):
        seq: list[int] = []
        while len(seq) < K:
            c = tuple(seq)
            if proposal == "argmax":
                drafts = argmaxes[c]
                listed = drafts.tolist()
                q = None if told is None else told[c]
            else:
                pool = pools.get(c)
                if pool is None or pool[1] == len(pool[2]):
                    bulk = torch.multinomial(t.q[c], 4096, replacement=True, generator=gen).T.contiguous()
                    pool = pools[c] = [bulk, 0, bulk.tolist()]
                drafts, listed = pool[0][pool[1]], pool[2][pool[1]]
                pool[1] += 1
                q = t.q[c] if told is None else told[c]
            rows = torch.tensor([ROW[c + tuple(listed[:i])] for i in range(DEPTH + 1)])
            v = verify_sampled(drafts, lambda a, b: t.p[rows[a:b]], q, gen)
            seq += listed[:v.num_accepted] + [v.next_token]
        out.append(tuple(seq[:K]))
    return _counts(out)


def tree_rates() -> TreeRates:
    """Rates that grow a tree three levels deep with several candidates per node, and that rank a
    node's third candidate above its second (a node may try ranks 0 and 2 only: the proposal of
    rank 2 is then q without both earlier draws, one of which that node never tried)."""
    rates = TreeRates()
    for d in range(1, DEPTH + 1):
        for r, rate in enumerate((0.8, 0.15, 0.3, 0.05)):
            rates.tried[(d, r)], rates.accepted[(d, r)] = 1000, 1000 * rate
    return rates


TREE_BUDGET = 12


def tree_draws(t: Toy, n: int, seed: int, told: dict | None = None) -> torch.Tensor:
    """As `chain_draws`, with a token tree per step the way proposers/tree.py builds one for sampled
    proposals (`draft_candidates` without replacement, `build_tree` unmerged with the q they were
    drawn from) verified by `verify_tree_sampled` (multi-candidate rejection sampling)."""
    gen = torch.Generator().manual_seed(seed)
    rates = tree_rates()
    out = []
    for _ in range(n):
        seq: list[int] = []
        while len(seq) < K:
            c = tuple(seq)
            cands = draft_candidates(t.q[c], WIDTH, True, gen)
            tree = build_tree(cands, seq[-1] if seq else 0, TREE_BUDGET, rates, merge=False,
                              q=t.q[c] if told is None else told[c])

            def p_at(i: int, tree=tree, c=c) -> torch.Tensor:
                path = []
                while i > 0:
                    path.append(tree.tokens[i])
                    i = tree.parents[i]
                return t.p[ROW[c + tuple(reversed(path))]]

            v = verify_tree_sampled(tree, p_at, gen)
            seq += [tree.tokens[i] for i in v.path[1:]] + [v.next_token]
        out.append(tuple(seq[:K]))
    return _counts(out)


# ---------------------------------------------------------------- the exact law of a verification walk

def _stages(p: list[float], ranks: list[int], candidates: list[tuple[float, tuple]], told) -> tuple[list, list]:
    """One node of the walk: its children (ranks, in verification order) try the candidates of
    their depth, drawn as `candidates` ((probability, tokens by rank), every possible draw);
    `told(earlier)` is the proposal the verifier divides by for a candidate drawn after the
    tokens `earlier` (None: a deterministic candidate, q one-hot). Returns per child the mass of
    each token accepted there, and the mass of each token drawn from what is left of p (the
    recovered token), as the library's rule does: accept x with min(1, p(x)/q'(x)), else
    p <- normalize(max(0, p - q'))."""
    accepted = [[0.0] * V for _ in ranks]
    recovered = [0.0] * V
    for prob, tokens in candidates:
        left, reach = list(p), prob
        for k, r in enumerate(ranks):
            x = tokens[r]
            q = told(tokens[:r])
            q = [float(i == x) for i in range(V)] if q is None else q
            a = min(1.0, left[x] / q[x]) if q[x] > 0 else float(left[x] > 0)
            accepted[k][x] += reach * a
            reach *= 1 - a
            if reach == 0:
                break
            rest = [max(0.0, li - qi) for li, qi in zip(left, q)]
            total = sum(rest)
            left = [r_ / total for r_ in rest] if total > 0 else list(p)
        for x in range(V):
            recovered[x] += reach * left[x]
    return accepted, recovered


def _without(q: list[float], earlier: tuple) -> list[float]:
    """q without the tokens drawn before, renormalised (tree._proposal)."""
    q = [0.0 if i in earlier else qi for i, qi in enumerate(q)]
    total = sum(q)
    return [qi / total for qi in q]


def _sequential_draws(q: list[float], m: int) -> list[tuple[float, tuple]]:
    """Every ordered draw of m tokens without replacement from q, with its probability."""
    out = []
    for tokens in itertools.permutations([i for i in range(V) if q[i] > 0], m):
        prob, left = 1.0, 1.0
        for x in tokens:
            prob *= q[x] / left
            left -= q[x]
        out.append((prob, tokens))
    return out


@dataclass
class Walk:
    """What a step does at each context: its shape (a chain is a tree of one child per level),
    how its candidates are drawn, and what the verifier is told."""

    t: Toy
    kind: str  # "sample" chain, "argmax" chain, or "tree" (sampled candidates)
    told: dict | None = None  # context -> [DEPTH, V] the q the verifier is told (None: the true q)

    def shape(self, c: tuple) -> Tree:
        if self.kind != "tree":
            return Tree(list(range(DEPTH + 1)), list(range(-1, DEPTH)), list(range(DEPTH + 1)), [0] * (DEPTH + 1))
        width = min(WIDTH, int((self.t.q[c] > 0).sum(-1).min()))
        placeholders = [[(d, r) for r in range(width)] for d in range(DEPTH)]
        return build_tree(placeholders, None, TREE_BUDGET, tree_rates(), merge=False)

    def node(self, c: tuple, tree: Tree, node: int, p: list[float]) -> tuple[list[int], list, list]:
        kids = tree.children(node)
        if not kids:
            return kids, [], list(p)
        d = tree.depths[node]  # its children propose block position d + 1
        q = self.t.q[c][d].double().tolist()
        told = (self.told or self.t.q)[c][d].double().tolist()
        ranks = [tree.ranks[k] for k in kids]
        if self.kind == "argmax":
            candidates = [(1.0, (max(range(V), key=q.__getitem__),))]
            rule = (lambda earlier: None) if self.told is None else (lambda earlier: told)
        elif self.kind == "sample":
            candidates = [(q[x], (x,)) for x in range(V) if q[x] > 0]
            rule = lambda earlier: told  # noqa: E731
        else:
            candidates = _sequential_draws(q, max(ranks) + 1)
            rule = lambda earlier: _without(told, earlier)  # noqa: E731
        accepted, recovered = _stages(p, ranks, candidates, rule)
        return kids, accepted, recovered


def walk_law(w: Walk) -> torch.Tensor:
    """The exact law [V] * K of the first K committed tokens of steps after steps of `w`."""
    shapes = {c: w.shape(c) for c in CONTEXTS}
    memo: dict = {}

    def law(prefix: tuple, start: tuple, node: int) -> torch.Tensor:
        if len(prefix) == K:
            return torch.ones((), dtype=torch.float64)
        key = (prefix, start, node)
        if key not in memo:
            p = w.t.p[ROW[prefix]].double().tolist()
            kids, accepted, recovered = w.node(start, shapes[start], node, p)
            rows = []
            for x in range(V):
                row = recovered[x] * law(prefix + (x,), prefix + (x,), 0)
                for kid, mass in zip(kids, accepted):
                    if mass[x] > 0:
                        row = row + mass[x] * law(prefix + (x,), start, kid)
                rows.append(row)
            memo[key] = torch.stack(rows)
        return memo[key]

    return law((), (), 0)


def depth_tv(w: Walk, depth: int) -> float:
    """How wrong the walk's verdict is at `depth`: the total variation between the law of the
    token committed at a node of level depth - 1 of the first step and the target's law there,
    averaged over where the walk reaches (weighted by the probability it gets there)."""
    tree = w.shape(())
    frontier = [(0, (), 1.0)]  # (node, prefix, probability the walk is there)
    for _ in range(depth - 1):
        nxt = []
        for node, prefix, weight in frontier:
            kids, accepted, _ = w.node((), tree, node, w.t.p[ROW[prefix]].double().tolist())
            nxt += [(kid, prefix + (x,), weight * mass[x]) for kid, mass in zip(kids, accepted)
                    for x in range(V) if mass[x] > 0]
        frontier = nxt
    total = tv = 0.0
    for node, prefix, weight in frontier:
        p = w.t.p[ROW[prefix]].double().tolist()
        _, accepted, recovered = w.node((), tree, node, p)
        got = [recovered[x] + sum(m[x] for m in accepted) for x in range(V)]
        total += weight
        tv += weight * 0.5 * sum(abs(a - b) for a, b in zip(got, p))
    return tv / total


# ---------------------------------------------------------------- the statistics, and the filters

def test_the_statistics_have_their_size_and_power():
    """The critical values are the chi-square's (tables: 23.93 at 1 degree of freedom, 35.89 at
    5, for alpha 10^-6), the noncentral power is the normal one at 1 degree of freedom, and on
    10^5 draws of a toy's exact law the battery keeps it, and rejects a law 0.015 off at depth 3."""
    assert chi2_critical(1) == pytest.approx(23.928, abs=1e-3) and chi2_critical(5) == pytest.approx(35.888, abs=1e-3)
    for lam in (0.0, 10.0, 40.0):  # chi-square(1, lam) = (Z + sqrt(lam))^2
        x, mu = 23.928, math.sqrt(lam)
        ndtr = lambda z: float(torch.special.ndtr(torch.tensor(z, dtype=torch.float64)))  # noqa: E731
        normal = ndtr(-math.sqrt(x) - mu) + ndtr(mu - math.sqrt(x))
        assert ncx2_sf(x, 1, lam) == pytest.approx(normal, rel=1e-6)
    case = CASES[0]
    t = case.toy()
    law = t.law()
    gen = torch.Generator().manual_seed(0)

    def counts(of: torch.Tensor) -> torch.Tensor:
        return torch.bincount(torch.multinomial(of.flatten().float(), DRAWS, replacement=True, generator=gen),
                              minlength=V ** K).view([V] * K)

    assert not rejected(battery(counts(law), law))
    assert rejected(battery(counts(walk_law(Walk(t, case.kind, case.told(t, 3)))), law))


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' definition: its warpers in generate's order (temperature, top-k, top-p)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return torch.softmax(scores, -1)


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=3), SamplingParams(0.7, top_p=0.8),
                                    SamplingParams(1.3, top_k=5, top_p=0.9), SamplingParams(0.5, top_k=1),
                                    SamplingParams(2.0, top_p=0.3), SamplingParams(1.0, top_k=20, top_p=0.99)])
def test_top_k_and_top_p_are_transformers_definitions(params):
    """The law the engine samples (and speculative sampling must keep) is the target's after
    transformers' TopKLogitsWarper and TopPLogitsWarper: the same tokens kept (ties at the k-th
    score all kept, the token that crosses top_p kept, the first always) and the same
    probabilities, on 4000 random rows of 12 tokens at scales from flat to peaked. One difference,
    at exact ties only: where top_p falls inside a run of equal scores, both keep as many of them,
    but not the same ones (each keeps those its sort puts first: descending here, ascending in
    transformers); rows with such ties keep the same probabilities, on other token ids."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 12, generator=g) * torch.linspace(0.1, 6, 4000)[:, None]
    ties = 100
    logits[:ties, :4] = 1.5  # four equal scores at the top: the k-th among them, top_p inside them
    mine, ref = probs_from_logits(logits, params), reference_probs(logits, params)
    assert torch.equal(mine[ties:] > 0, ref[ties:] > 0)
    torch.testing.assert_close(mine[ties:], ref[ties:], rtol=0, atol=1e-6)
    torch.testing.assert_close(mine[:ties].sort(-1).values, ref[:ties].sort(-1).values, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- the tests at the level of the verification functions

@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "sample" chain, "argmax" chain, "tree"
    params: SamplingParams
    shape: tuple  # toy(...)'s sharp, spread, guess, seed: chosen so that the walk reaches depth 3 often
    bias: tuple  # the negative controls' strength at depth 1 and at depth 3 (a temperature factor, or eps for argmax)

    def toy(self) -> Toy:
        sharp, spread, guess, seed = self.shape
        return toy(self.params, seed, sharp, spread, guess)

    def told(self, t: Toy, depth: int) -> dict:
        strength = self.bias[0 if depth == 1 else 1]
        return t.told_argmax(strength, depth) if self.kind == "argmax" else t.told(strength, depth)

    def draws(self, t: Toy, seed: int, told: dict | None = None) -> torch.Tensor:
        if self.kind == "tree":
            return tree_draws(t, DRAWS, seed, told)
        return chain_draws(t, DRAWS, seed, self.kind, told)


CASES = [
    Case("chain-sampled-topk-topp", "sample", SamplingParams(1.0, top_k=5, top_p=0.95), (2.0, 0.3, 0.2, 0),
         (1.175, 1.141)),
    Case("chain-argmax", "argmax", SamplingParams(1.0), (3.0, 0.3, 0.2, 2), (0.081, 0.299)),
    Case("tree-sampled-topk", "tree", SamplingParams(0.9, top_k=5), (2.0, 0.5, 0.3, 0), (1.112, 1.127)),
]
CONTROL_TV = (0.014, 0.016)  # the controls' total variation at their depth (`depth_tv`), within 0.01-0.02


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_walk_model_is_exact_and_the_controls_are_calibrated(case):
    """The model of the verification walk that the power calculations rest on gives the target's
    law for the true q (for every tree shape and candidate law a case uses), and each negative
    control is wrong by a total variation of 0.014-0.016 at its own depth alone, a bias the test
    of its case detects with power > 0.99 at 10^5 draws (the noncentrality of the best of the
    battery's statistics against the control's exact law)."""
    t = case.toy()
    law = t.law()
    assert power_at_tv(law, DRAWS, 0.02) > POWER  # any law of the 3 tokens off by TV 0.02, whatever its shape
    right = Walk(t, case.kind)
    torch.testing.assert_close(walk_law(right), law, rtol=0, atol=1e-6)
    assert depth_tv(right, 1) < 1e-6 and depth_tv(right, 3) < 1e-6
    tree = right.shape(())
    assert max(tree.depths) == DEPTH
    if case.kind == "tree":  # several candidates at depth 3, and a node that tries ranks 0 and 2 alone
        assert tree.shape()[DEPTH] >= 3
        assert any([tree.ranks[k] for k in tree.children(i)] == [0, 2] for i in range(len(tree)))
    for depth in (1, 3):
        biased = Walk(t, case.kind, case.told(t, depth))
        assert CONTROL_TV[0] < depth_tv(biased, depth) < CONTROL_TV[1]
        assert depth_tv(biased, 4 - depth) < 1e-6  # the other depth is right
        assert battery_power(walk_law(biased), law, DRAWS) > POWER


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["library", "biased-at-depth-1", "biased-at-depth-3"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_verification_keeps_the_target_law_with_power(case, sampler):
    """10^5 draws of the first 3 committed tokens through the library's verification: the
    battery keeps the target's law for the library's rule and rejects each negative control (the
    power > 0.99 of each is asserted in the test above)."""
    t = case.toy()
    if sampler == "library":
        results = battery(case.draws(t, seed=1), t.law())
        assert not rejected(results), results
    else:
        depth = int(sampler[-1])
        results = battery(case.draws(t, seed=2 + depth, told=case.told(t, depth)), t.law())
        assert rejected(results), results


# ---------------------------------------------------------------- the whole engine

ENGINE_VOCAB = 8
ENGINE_PROMPT = [1, 2, 3]
ENGINE_TOKENS = 4  # t1 from the prompt's logits, t2..t4 from the first block: its drafts at depths 1..3
ROWS = [  # a batch's rows: (sampling, proposal, tree budget)
    (SamplingParams(1.0), "sample", None),  # a chain of sampled drafts
    (SamplingParams(0.7, top_p=0.8), "sample", None),
    (SamplingParams(1.3, top_k=3), "greedy", None),  # argmax drafts at T > 0
    (SamplingParams(1.0, top_p=0.9), "sample", 8),  # a tree of sampled candidates
    (SamplingParams(0.8), "greedy", 8),  # a tree of argmax candidates
    (SamplingParams(0.0), "sample", None),  # greedy decoding beside them
]


def engine_target():
    """A tiny random target whose laws are peaked and depend on the context (its LM head scaled
    30x: a random tiny model's logits are all near 0, its laws near uniform, where a wrong law
    looks like a right one)."""
    target = tiny_target("llama", vocab=ENGINE_VOCAB, layers=2)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(30)
    return target


class BatchOracle(OracleDraft):
    """OracleDraft in a batch too. draft_blocks runs the blocks of several sequences as
    head(blocks_hidden(...)), which OracleDraft's methods do not see (there it would propose
    what the random drafter beneath it does); here the head returns the oracle's proposals for
    those rows, after the real forward and head."""

    _batched = None

    def blocks_hidden(self, embed, caches, context_taps, anchors, positions, block):
        self._batched = (list(positions), block)
        return super().blocks_hidden(embed, caches, context_taps, anchors, positions, block)

    def head_for(self, lm_head):
        real = super().head_for(lm_head)

        def head(hidden):
            logits = real(hidden)
            if self._batched is None:
                return logits
            positions, block = self._batched
            self._batched = None
            return torch.stack([self.proposal_logits(p, block, row) for p, row in zip(positions, logits)])

        return head


def oracle_engine(target, keep: float = 0.8) -> tuple[Engine, list[int]]:
    """The engine with an oracle drafter (the target's greedy continuation, each token kept with
    probability `keep`, else a wrong one with the truth second: q one-hot or two-point), and the
    greedy continuation."""
    greedy = Engine(target).generate(ENGINE_PROMPT, GenerationConfig(max_new_tokens=64, stop_token_ids=())).token_ids
    draft = BatchOracle(tiny_draft(target, block_size=4), greedy, len(ENGINE_PROMPT), keep, seed=1)
    return Engine(target, draft), greedy


def run_batch(engine: Engine, rounds: int, new_tokens: int, copies: int = 1, seed: int = 0) -> list[list[tuple]]:
    """Rounds of one batch of every row of ROWS (`copies` of each sampled one), each request
    seeded, blocks of 4 (3 drafts), no prompt lookup: per row, each request's (tokens, first
    step's accepted drafts)."""
    out: list[list[tuple]] = [[] for _ in ROWS]
    for r in range(rounds):
        batch = engine.batch()
        got = {}
        for i, (sp, proposal, tree) in enumerate(ROWS):
            for _ in range(copies if sp.temperature else 1):
                params = SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed=seed + 1000 * r + len(got))
                cfg = GenerationConfig(max_new_tokens=new_tokens, stop_token_ids=(), block_size=4, lookup=False,
                                       proposal=proposal, tree_budget=tree, sampling=params, coupling="rejection")
                seq, first = batch.join(ENGINE_PROMPT, cfg, GenerationStats())
                got[id(seq)] = (i, list(first.tokens), [])
        while batch.sequences:
            for seq, step in batch.step():
                got[id(seq)][1].extend(step.tokens)
                got[id(seq)][2].append(step.num_accepted)
        for i, tokens, accepted in got.values():
            out[i].append((tuple(tokens), accepted[0]))
    return out


def engine_rows(target, params: SamplingParams, contexts: list[list[int]]) -> torch.Tensor:
    """The target's law [len(contexts), V] after each context (all of one length), from its own
    forward over the whole sequence (no cache, no engine)."""
    with torch.inference_mode():
        logits = target.model(torch.tensor(contexts)).logits[:, -1]
    return probs_from_logits(logits, params)


def engine_law(target, params: SamplingParams) -> torch.Tensor:
    """The exact law [V] * ENGINE_TOKENS of the first tokens after ENGINE_PROMPT."""
    law = torch.ones([1] * 0, dtype=torch.float64)
    for n in range(ENGINE_TOKENS):
        prefixes = list(itertools.product(range(ENGINE_VOCAB), repeat=n))
        rows = engine_rows(target, params, [ENGINE_PROMPT + list(s) for s in prefixes]).double()
        law = law.unsqueeze(-1) * rows.view([ENGINE_VOCAB] * n + [ENGINE_VOCAB])
    return law


def test_the_engine_hands_the_verifier_the_target_rows_and_the_q_its_drafts_came_from(monkeypatch):
    """Exactly, not statistically: in a batch whose rows sample differently (temperatures, top-k,
    top-p; sampled and argmax drafts; chains and trees of 3 levels), every verdict reads, at every
    depth, the target's law after that row's own context and drafts with that row's own filter,
    the same as the target's own forward over the whole sequence gives (within fp32 noise), and
    is told the q its drafts were drawn from. With the tests above (the verification functions
    keep the law of whatever rows and q they are given), the engine keeps the target's law; a
    row read from another sequence, depth, cache state or filter would show here at any size."""
    from blockdraft.decoding import engine as engine_module
    from blockdraft.decoding import verify as verify_module
    from blockdraft.decoding.proposers import chain as chain_module
    from blockdraft.decoding.proposers import tree as tree_module

    target = engine_target()
    engine, _ = oracle_engine(target)
    seqs = {}  # a request's generator -> its sequence (each sampled request has its own)
    real_join = engine_module.Batch.join

    def join(self, prompt_ids, config, stats):
        seq, first = real_join(self, prompt_ids, config, stats)
        if seq.gen is not None:
            seqs[id(seq.gen)] = seq
        return seq, first

    drawn = {}  # generator -> (probs, draws) of its last draft draw
    real_sample, real_candidates = chain_module.sample, tree_module.draft_candidates

    def sample(probs, gen):
        out = real_sample(probs, gen)
        drawn[id(gen)] = (probs, out)
        return out

    def candidates(probs, width, sampled, gen=None):
        out = real_candidates(probs, width, sampled, gen)
        if sampled:
            drawn[id(gen)] = (probs, out)
        return out

    checked = {"chain": [0] * (DEPTH + 1), "tree": [0] * (DEPTH + 1)}

    def expect(seq, paths: list[list[int]], got: torch.Tensor) -> None:
        context = seq.prompt_ids + seq.stopper.generated  # the committed tokens, the anchor last
        by_length: dict = {}
        for i, path in enumerate(paths):
            by_length.setdefault(len(path), []).append(i)
        for n, rows in by_length.items():
            want = engine_rows(target, seq.config.sampling, [context + paths[i] for i in rows])
            torch.testing.assert_close(got[rows], want, rtol=0, atol=2e-4)

    real_chain, real_tree = verify_module.verify_sampled, verify_module.verify_tree_sampled

    def chain(drafts, p, q, generator=None, first_chunk=None):
        n, listed = len(drafts), list(drafts)
        if n == 0:  # a plain step (or the prefill's token): no drafts to check
            return real_chain(drafts, p, q, generator, first_chunk)
        seq = seqs[id(generator)]
        expect(seq, [listed[:k] for k in range(n + 1)], p(0, n + 1))
        if seq.config.proposal == "greedy":
            assert q is None
        else:
            probs, draws = drawn.pop(id(generator))
            # a chain's draws [n]; a chain-shaped tree's candidates [D][width], its rank-0 ones on the path
            drafted = draws.tolist() if isinstance(draws, torch.Tensor) else [c[0] for c in draws[:n]]
            assert q is probs and drafted == listed
        checked["chain"][n] += 1
        return real_chain(drafts, p, q, generator, first_chunk)

    def tree(t, p_at, generator=None):
        seq = seqs[id(generator)]
        paths = []
        for i in range(len(t)):
            path, j = [], i
            while j > 0:
                path.append(t.tokens[j])
                j = t.parents[j]
            paths.append(path[::-1])
        expect(seq, paths, torch.stack([p_at(i) for i in range(len(t))]))
        if seq.config.proposal == "greedy":
            assert t.q is None
        else:
            probs, draws = drawn.pop(id(generator))
            assert t.q is probs and t.candidates == draws
        checked["tree"][max(t.depths)] += 1
        return real_tree(t, p_at, generator)

    monkeypatch.setattr(engine_module.Batch, "join", join)
    monkeypatch.setattr(chain_module, "sample", sample)
    monkeypatch.setattr(tree_module, "draft_candidates", candidates)
    monkeypatch.setattr(verify_module, "verify_sampled", chain)
    monkeypatch.setattr(verify_module, "verify_tree_sampled", tree)
    runs = run_batch(engine, rounds=4, new_tokens=32)
    greedy = Engine(target).generate(ENGINE_PROMPT, GenerationConfig(max_new_tokens=32, stop_token_ids=()))
    assert all(tokens == tuple(greedy.token_ids) for tokens, _ in runs[-1])  # the greedy row, among them
    assert checked["chain"][DEPTH] >= 50 and checked["tree"][DEPTH] >= 50, checked  # depth-3 blocks and trees


ENGINE_ROUNDS = 800  # batches of all of ROWS: 800 draws per row, about 30 s
MIX = 0.15  # the engine's negative control: its depth-3 rows 15% the row before (TV ~0.15 there)


def mixed_row_law(law: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    """The law of the first 4 tokens when the verdict at depth 3 of the first block (whose row
    gives t4) reads (1 - MIX) p(. | t1 t2 t3) + MIX p(. | t1 t2) instead of p(. | t1 t2 t3), where
    the walk gets there (`reach`: the probability that it does, by t1 t2 t3, measured). The
    verification is exact for the row it reads, so t4 follows that row there."""
    three = law.sum(-1)
    after3 = law / three.unsqueeze(-1).clamp_min(1e-300)
    after2 = three / three.sum(-1, keepdim=True).clamp_min(1e-300)
    wrong = (1 - MIX) * after3 + MIX * after2.unsqueeze(2)
    return three.unsqueeze(-1) * ((1 - reach).unsqueeze(-1) * after3 + reach.unsqueeze(-1) * wrong)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["library", "biased-at-depth-3"])
def test_the_engine_keeps_the_target_law_in_a_batch_of_mixed_rows(sampler, monkeypatch):
    """The first 4 tokens of every row of a batch whose rows sample differently (ROWS: T 0.7-1.3,
    top-k, top-p, sampled and argmax drafts, chains and trees, a greedy row), with oracle drafts
    whose first block reaches depth 3 in 23-57% of the draws (by row), against each row's exact
    law: end to end, commits and caches included. 800 draws per row cannot see the tests above's
    TV 0.015; its negative control is a verdict whose depth-3 rows (the second lazy chunk of a
    chain, a tree's second-level nodes) are mixed 15% with the row before (TV ~0.15 there), which
    every row's test rejects with power > 0.99 (computed from the reach measured per context)."""
    from blockdraft.decoding import verify as verify_module

    target = engine_target()
    engine, greedy = oracle_engine(target)
    if sampler != "library":
        real_chain, real_tree = verify_module.verify_sampled, verify_module.verify_tree_sampled

        def chain(drafts, p, q, generator=None, first_chunk=None):
            rows = p(0, len(drafts) + 1).clone()
            if len(drafts) >= DEPTH:
                rows[DEPTH - 1] = (1 - MIX) * rows[DEPTH - 1] + MIX * rows[DEPTH - 2]
            return real_chain(drafts, rows, q, generator, first_chunk)

        def tree(t, p_at, generator=None):
            def mixed(i):
                if t.depths[i] != DEPTH - 1:
                    return p_at(i)
                return (1 - MIX) * p_at(i) + MIX * p_at(t.parents[i])

            return real_tree(t, mixed, generator)

        monkeypatch.setattr(verify_module, "verify_sampled", chain)
        monkeypatch.setattr(verify_module, "verify_tree_sampled", tree)
    runs = run_batch(engine, rounds=ENGINE_ROUNDS, new_tokens=ENGINE_TOKENS, seed=10 ** 6)
    for (params, proposal, tree_budget), run in zip(ROWS, runs):
        if params.greedy:
            assert all(tokens == tuple(greedy[:ENGINE_TOKENS]) for tokens, _ in run)
            continue
        law = engine_law(target, params)
        counts = torch.zeros([ENGINE_VOCAB] * ENGINE_TOKENS)
        hits, deep = torch.zeros([ENGINE_VOCAB] * 3), torch.zeros([ENGINE_VOCAB] * 3)
        for tokens, accepted in run:
            counts[tokens] += 1
            hits[tokens[:3]] += 1
            deep[tokens[:3]] += accepted >= DEPTH - 1  # t4 came from the first block's depth 3
        results = battery(counts, law)
        if sampler == "library":
            assert power_at_tv(law, len(run), 0.2) > POWER  # any law of the 4 tokens off by TV 0.2
            assert not rejected(results), (params, proposal, tree_budget, results)
        else:
            reach = (deep / hits.clamp_min(1)).double()
            assert battery_power(mixed_row_law(law, reach), law, len(run)) > POWER
            assert rejected(results), (params, proposal, tree_budget, results)
