"""Sampling must preserve the target's distribution: statistical tests, not exact match."""


import pytest
import torch

from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.decoding.verify import SamplingParams, probs_from_logits, verify_sampled

from conftest import tiny_draft, tiny_target


def total_variation(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


@pytest.mark.parametrize("greedy_proposals", [False, True])
def test_first_committed_token_follows_p(greedy_proposals):
    """Whatever q is, the first committed token is distributed as p_0 (accepted d_1 or recovered)."""
    torch.manual_seed(0)
    V, n, draws = 6, 3, 20000
    p = torch.softmax(torch.randn(n + 1, V) * 1.5, -1)
    q = torch.softmax(torch.randn(n, V) * 1.5, -1)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(V)
    for _ in range(draws):
        if greedy_proposals:
            d = q.argmax(-1)
            v = verify_sampled(d, p, None, gen)
        else:
            d = torch.multinomial(q, 1, generator=gen)[:, 0]
            v = verify_sampled(d, p, q, gen)
        first = d[0].item() if v.num_accepted >= 1 else v.next_token
        counts[first] += 1
    # 20000 draws over 6 outcomes: sampling noise gives TV ~0.01; a biased rule gives far more
    assert total_variation(counts, p[0]) < 0.02


def test_tv_detects_a_wrong_rule():
    """The statistic above can fail: accepting every draft would give q_0, not p_0."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6) * 1.5, -1)
    q = torch.softmax(torch.randn(6) * 1.5, -1)
    counts = torch.bincount(torch.multinomial(q, 20000, replacement=True), minlength=6).float()
    assert total_variation(counts, p) > 0.05


def test_top_k_top_p_restrict_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0, 0] == 1.0  # the first token alone has mass >= 0.5


@pytest.mark.parametrize("proposal,subset,draft_dtype,tree", [("sample", None, None, None), ("greedy", None, None, None),
                                                              ("sample", [0, 2, 5, 6], None, None),
                                                              ("sample", None, torch.bfloat16, None),
                                                              ("sample", None, None, 6), ("greedy", None, None, 6)])
def test_engine_sampling_matches_exact_two_token_distribution(proposal, subset, draft_dtype, tree):
    """Speculative sampling's joint distribution of the first two new tokens equals the target's,
    computed exactly by enumeration (tiny vocabulary, temperature 1.5, top-k 5); also with a
    draft vocabulary subset (vocab.py), where q is zero outside the subset, with the drafter
    in bf16 beside an fp32 target (q is whatever the bf16 drafter computed), and with token
    trees of 6 nodes (tree.py) of sampled and of argmax candidates."""
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
        cfg = GenerationConfig(max_new_tokens=2, stop_token_ids=(), proposal=proposal, tree_budget=tree,
                               block_size=4 if tree else None, sampling=SamplingParams(**params, seed=seed))
        a, b = engine.generate(prompt, cfg).token_ids
        counts[a, b] += 1
    # 3000 draws over <= 25 outcomes: noise TV ~0.04; assert well inside what a bias would give
    assert total_variation(counts.flatten(), exact.flatten()) < 0.07


def test_seed_makes_sampling_reproducible():
    target = tiny_target("qwen3")
    engine = Engine(target, tiny_draft(target))
    cfg = GenerationConfig(max_new_tokens=20, stop_token_ids=(), sampling=SamplingParams(1.0, 0, 0.9, seed=7))
    assert engine.generate([4, 5, 6], cfg).token_ids == engine.generate([4, 5, 6], cfg).token_ids
