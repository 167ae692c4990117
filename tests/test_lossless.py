"""Greedy speculative decoding must equal plain greedy decoding token for token."""

import pytest

from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.decoding.oracle import OracleDraft

from conftest import record_draft_contexts, tiny_draft, tiny_target

PROMPTS = [[5, 17, 33, 2], [7] * 12, list(range(3, 40))]


def greedy(engine, prompt, n=48, block_size=None, adaptive=True):
    cfg = GenerationConfig(max_new_tokens=n, block_size=block_size, stop_token_ids=(), adaptive=adaptive,
                           lookup=False)  # the drafter alone (test_lookup.py covers lookup on top)
    return engine.generate(prompt, cfg)


@pytest.mark.parametrize("block_size", [2, 3, 5, 8, 16])
def test_random_drafter_matches_plain_decoding(target, block_size):
    draft = tiny_draft(target, block_size=block_size)
    plain, spec = Engine(target), Engine(target, draft)
    for prompt in PROMPTS:
        expected = greedy(plain, prompt).token_ids
        got = greedy(spec, prompt, block_size=block_size)
        assert got.token_ids == expected
        assert len(expected) == 48
        assert sum(got.stats.acceptance_lengths) + 1 == 48  # the prefill token plus every step's


@pytest.mark.parametrize("block_size", [2, 4, 7, 16])
@pytest.mark.parametrize("keep", [0.0, 0.6, 1.0])
def test_oracle_drafter_partial_full_and_zero_acceptance(target, block_size, keep):
    plain = Engine(target)
    for prompt in PROMPTS:
        truth = greedy(plain, prompt, n=60).token_ids
        oracle = OracleDraft(tiny_draft(target, block_size=block_size), truth, len(prompt), keep, seed=3)
        got = greedy(Engine(target, oracle), prompt, n=60, block_size=block_size)
        assert got.token_ids == truth
        lengths = got.stats.acceptance_lengths
        if keep == 1.0:  # every draft accepted: full blocks except where the length limit cuts
            assert max(lengths) == block_size and sorted(lengths)[len(lengths) // 2] == block_size
        elif keep == 0.0:
            assert set(lengths) == {1}
        elif block_size >= 4:
            assert 1 < got.stats.tau < block_size


def test_fewer_block_sizes_at_inference_than_training(target):
    """A drafter trained with B=16 may run with smaller blocks; output stays identical."""
    draft = tiny_draft(target, block_size=16)
    plain = greedy(Engine(target), PROMPTS[2]).token_ids
    for b in (1, 2, 9, 16):
        assert greedy(Engine(target, draft), PROMPTS[2], block_size=b).token_ids == plain


def test_stop_token_and_length_limit():
    target = tiny_target("llama")
    plain = Engine(target)
    free = greedy(plain, PROMPTS[0], n=30).token_ids
    stop = free[10]
    first = free.index(stop)
    cfg = GenerationConfig(max_new_tokens=30, stop_token_ids=(stop,))
    truth = free[: first + 1]
    oracle = OracleDraft(tiny_draft(target, block_size=8), free, len(PROMPTS[0]), 1.0)
    for engine in (plain, Engine(target, oracle)):
        res = engine.generate(PROMPTS[0], cfg)
        assert res.token_ids == truth and res.finish_reason == "stop"
    res = Engine(target, oracle).generate(PROMPTS[0], GenerationConfig(max_new_tokens=7, stop_token_ids=()))
    assert res.token_ids == free[:7] and res.finish_reason == "length"


def test_plain_steps_inside_speculative_decoding_keep_the_draft_context(monkeypatch):
    """Steps of block 1 (no draft), which the adaptive policy takes when acceptance is poor,
    must not lose pending draft context: each draft forward sees context up to its anchor."""
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=6)
    seen = record_draft_contexts(monkeypatch, draft)
    plain = greedy(Engine(target), PROMPTS[0], n=60).token_ids
    from test_adaptive import SimulatedClock  # costs that do not depend on this machine's speed

    got = greedy(Engine(target, draft, clock=SimulatedClock(target, draft)), PROMPTS[0], n=60)  # plain steps, probes
    assert got.token_ids == plain
    drafted_steps = len(seen)
    assert 2 <= drafted_steps < len(got.stats.acceptance_lengths)  # both kinds of step occurred
    assert all(ctx == pos for ctx, pos in seen)  # context always reaches up to the anchor
