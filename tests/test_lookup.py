"""Prompt-lookup proposals inside the engine: free proposals, verified like a drafter's block."""

import pytest
import torch

from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.decoding.lookup import lookup_proposals
from blockdraft.decoding.oracle import OracleDraft
from blockdraft.decoding.verify import SamplingParams, probs_from_logits

from conftest import record_draft_contexts, tiny_draft, tiny_target
from test_sampling import total_variation

PROMPTS = [[5, 17, 33, 2, 5, 17, 40], [7] * 12, list(range(3, 40)) + list(range(3, 20))]


def test_proposals_follow_the_most_recent_longest_match():
    def found(tokens, k):
        hit = lookup_proposals(tokens, k)
        return (hit.tokens, hit.ngram) if hit else None

    assert found([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2) == ([8, 1], 3)  # the latest "1 2 3"
    assert found([4, 2, 3, 9, 9, 1, 2, 3], 3) == ([9, 9, 1], 2)  # "2 3" beats a later "3"
    assert found([1, 2, 5, 6, 2], 10) == ([5, 6, 2], 1)  # up to the end of the context
    assert found([1, 2, 3, 4], 5) is None  # no earlier occurrence
    assert found([1, 2, 1, 2], 0) is None and found([3], 4) is None
    assert found([7, 7, 7], 4) == ([7], 2)  # overlapping occurrence, next token exists


@pytest.mark.parametrize("block_size, trees", [(None, None), (None, "auto"), (4, None), (16, None)])
def test_greedy_output_is_unchanged_with_lookup(target, block_size, trees):
    plain = Engine(target)
    draft = tiny_draft(target, block_size=8)
    used = 0
    for prompt in PROMPTS:
        cfg = GenerationConfig(max_new_tokens=48, stop_token_ids=(), block_size=block_size)
        truth = plain.generate(prompt, cfg).token_ids
        oracle = OracleDraft(draft, truth, len(prompt), 0.7, seed=1)
        for engine in (Engine(target), Engine(target, draft), Engine(target, oracle)):
            res = engine.generate(prompt, GenerationConfig(max_new_tokens=48, stop_token_ids=(),
                                                           block_size=block_size, lookup=True, tree_budget=trees))
            assert res.token_ids == truth
            assert sum(res.stats.acceptance_lengths) + 1 == 48
            used += res.stats.lookup_steps
    assert used > 0  # the repetitive prompts gave lookups


def test_lookup_steps_keep_the_draft_context(monkeypatch):
    """A lookup step runs no draft forward: its taps must wait for the next draft forward."""
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=6)
    seen = record_draft_contexts(monkeypatch, draft)
    prompt = PROMPTS[2]
    plain = Engine(target).generate(prompt, GenerationConfig(max_new_tokens=60, stop_token_ids=())).token_ids
    cfg = GenerationConfig(max_new_tokens=60, stop_token_ids=(), block_size=6, lookup=True)
    got = Engine(target, draft).generate(prompt, cfg)
    assert got.token_ids == plain
    assert 0 < got.stats.lookup_steps < len(got.stats.acceptance_lengths) and seen
    assert all(ctx == pos for ctx, pos in seen)


@pytest.mark.parametrize("with_draft", [False, True])
def test_lookup_sampling_matches_exact_two_token_distribution(with_draft):
    """Lookup proposals are deterministic (q one-hot): the second token, verified against them,
    must still follow the target's distribution exactly (enumerated; temperature 1.5)."""
    target = tiny_target("llama", vocab=8, layers=3)
    draft = tiny_draft(target, block_size=4) if with_draft else None
    sp = SamplingParams(temperature=1.5)
    prompt = [1, 2, 3, 4, 5, 6, 7, 0]  # every token occurs: each first token finds a lookup
    with torch.inference_mode():
        p1 = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1], sp)
        exact = torch.zeros(8, 8)
        for a in range(8):
            exact[a] = p1[a] * probs_from_logits(target.model(torch.tensor([prompt + [a]])).logits[0, -1], sp)
    engine = Engine(target, draft)
    counts = torch.zeros(8, 8)
    lookups = 0
    for seed in range(3000):
        cfg = GenerationConfig(max_new_tokens=2, stop_token_ids=(), lookup=True,
                               sampling=SamplingParams(temperature=1.5, seed=seed))
        res = engine.generate(prompt, cfg)
        a, b = res.token_ids
        counts[a, b] += 1
        lookups += res.stats.lookup_steps
    assert lookups > 2500  # (a seed fixes the block: proposals whenever the lookup finds one)
    assert total_variation(counts.flatten(), exact.flatten()) < 0.07


def test_lookup_is_on_by_default_and_every_command_can_turn_it_off():
    import inspect

    from blockdraft import cli

    assert GenerationConfig().lookup
    for argv, fn in ((["generate", "--prompt", "x"], cli.cmd_generate), (["serve"], cli.cmd_serve),
                     (["chat"], cli.cmd_chat)):
        assert vars(cli.build_parser().parse_args(argv))["lookup"] is True
        assert vars(cli.build_parser().parse_args(argv + ["--no-lookup"]))["lookup"] is False
        assert "lookup" in inspect.signature(fn).parameters  # main() passes it through
