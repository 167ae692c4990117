"""The Gumbel-max coupling (decoding/gumbel.py, issue 51): noise tied to (seed, position), so a
seeded request's text is the same whatever the schedule (block sizes, trees, lookup, batch
neighbours) and equals plain sampling with the same seed token for token; each draw follows the
target's law (chi-square at 10^-6 with stated power, test_sampling's statistics)."""

import pytest
import torch

from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.decoding.gumbel import Chooser, PositionNoise, gumbel_noise, perturbed
from blockdraft.decoding.verify import SamplingParams, probs_from_logits

from conftest import tiny_draft, tiny_target
from test_batch import drive, prompts
from test_sampling import battery, battery_power, power_at_tv, rejected


def test_noise_is_a_function_of_the_seed_and_the_position_alone():
    a = gumbel_noise(7, 100, 50)
    assert torch.equal(a, gumbel_noise(7, 100, 50))
    assert not torch.equal(a, gumbel_noise(7, 101, 50)) and not torch.equal(a, gumbel_noise(8, 100, 50))
    noise = PositionNoise(7)
    later = noise.rows([102, 100], 50)  # in any order, any number of times
    assert torch.equal(later[1], a) and torch.equal(noise.rows([100], 50)[0], a)
    for t in range(200):  # old positions are dropped, and made again the same if read again
        noise.rows([t], 50)
    assert torch.equal(noise.rows([100], 50)[0], a)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=4), SamplingParams(1.3, top_p=0.8)])
def test_coupled_draws_follow_the_target_law_jointly_over_positions(params):
    """50,000 seeds; the tokens at two positions (distinct logits), tested alone and jointly
    against p0 x p1; the battery rejects any law off by TV 0.03 with power > 0.99."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6) * 1.5
    p = probs_from_logits(logits, params)
    law = p[0][:, None] * p[1][None, :]
    draws = 50_000
    counts = torch.zeros(6, 6)
    for seed in range(draws):
        a, b = Chooser(params, PositionNoise(seed)).pick(logits, [5, 6]).tolist()
        counts[a, b] += 1
    assert power_at_tv(law, draws, 0.03) > 0.99
    assert not rejected(battery(counts, law))


def test_the_coupling_test_rejects_a_sampler_at_the_wrong_temperature():
    """The statistic above can fail: the same draws at a temperature 15% off (TV ~0.05)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6) * 1.5
    right, wrong = SamplingParams(1.0), SamplingParams(1.15)
    p, off = probs_from_logits(logits, right), probs_from_logits(logits, wrong)
    law, alt = p[0][:, None] * p[1][None, :], off[0][:, None] * off[1][None, :]
    draws = 20_000
    assert battery_power(alt, law, draws) > 0.99
    counts = torch.zeros(6, 6)
    for seed in range(draws):
        a, b = Chooser(wrong, PositionNoise(seed)).pick(logits, [5, 6]).tolist()
        counts[a, b] += 1
    assert rejected(battery(counts, law))


def test_perturbed_scores_keep_the_filtered_support_only():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    s = perturbed(logits, torch.zeros(1, 5), SamplingParams(1.0, top_k=2))
    assert torch.isinf(s[0, 2:]).all() and torch.isfinite(s[0, :2]).all()


SCHEDULES = {  # name -> the configuration's schedule fields (the text must not depend on them)
    **{f"block{b}": dict(block_size=b) for b in (1, 2, 3, 5, 8, 16)},
    "adaptive": dict(),
    "adaptive-no-lookup": dict(lookup=False),
    "tree6": dict(block_size=8, tree_budget=6),
    "tree-adaptive": dict(tree_budget=16),
    "tree-no-lookup": dict(tree_budget=16, lookup=False),
}


@pytest.mark.parametrize("params", [SamplingParams(0.7, seed=11), SamplingParams(1.0, top_p=0.9, seed=3)])
def test_a_seeded_request_gives_the_same_text_whatever_the_schedule(params):
    """Block sizes 1..16, chains and trees, fixed and adaptive, lookup on and off: the text of
    plain sampling (no drafter) with the same seed, token for token (a prompt that repeats itself,
    so that lookup proposes)."""
    target = tiny_target("llama", vocab=64)
    engine = Engine(target, tiny_draft(target, block_size=16))
    plain = Engine(target)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]
    base = dict(max_new_tokens=48, stop_token_ids=(), sampling=params)
    want = plain.generate(prompt, GenerationConfig(**base)).token_ids
    assert len(set(want)) > 5  # sampled text, not a constant
    for name, schedule in SCHEDULES.items():
        got = engine.generate(prompt, GenerationConfig(**base, **schedule))
        assert got.token_ids == want, name
    drafted = engine.generate(prompt, GenerationConfig(**base, block_size=8)).stats
    assert drafted.drafted > 0  # the drafter did propose (and the text still did not move)


def test_a_seeded_request_gives_the_same_text_alone_and_in_a_batch_of_eight():
    """Eight seeded requests at mixed temperatures, chains and trees, joining at different
    steps: each one's tokens are those it gets alone (and plain sampling's)."""
    target = tiny_target("llama")
    engine = Engine(target, tiny_draft(target, block_size=8))
    plain = Engine(target)
    requests = []
    for i, p in enumerate(prompts(8, seed=4)):
        params = SamplingParams([0.6, 1.0, 1.4][i % 3], top_k=[0, 20][i % 2], seed=100 + i)
        requests.append((p, GenerationConfig(max_new_tokens=20, stop_token_ids=(), sampling=params,
                                             tree_budget=8 if i % 2 else None)))
    alone = [plain.generate(p, cfg).token_ids for p, cfg in requests]
    assert [engine.generate(p, cfg).token_ids for p, cfg in requests] == alone
    got = drive(engine, requests, [0, 0, 0, 1, 2, 3, 5, 8])
    assert [got[i] for i in range(len(requests))] == alone


def test_unseeded_requests_differ_and_rejection_sampling_stays_available():
    target = tiny_target("llama")
    engine = Engine(target, tiny_draft(target, block_size=4))
    cfg = GenerationConfig(max_new_tokens=16, stop_token_ids=(), sampling=SamplingParams(1.0))
    assert engine.generate([4, 5, 6], cfg).token_ids != engine.generate([4, 5, 6], cfg).token_ids
    seeded = GenerationConfig(max_new_tokens=16, stop_token_ids=(), coupling="rejection",
                              sampling=SamplingParams(1.0, seed=5))
    assert engine.generate([4, 5, 6], seeded).token_ids == engine.generate([4, 5, 6], seeded).token_ids
