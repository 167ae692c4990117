"""Token trees (tree.py): built by expected value, verified in one target forward under a 4D
ancestor mask, the cache compacted to the accepted path; greedy output equals plain decoding."""

import pytest
import torch

from blockdraft.decoding import Engine, GenerationConfig
from blockdraft.errors import BlockdraftError
from blockdraft.oracle import OracleDraft
from blockdraft.tree import Tree, TreeRates, build_tree, verify_tree_greedy

from conftest import tiny_draft, tiny_target
from families import tiny_family

PROMPTS = [[5, 17, 33, 2], list(range(3, 40))]


def greedy(engine, prompt, n=40, budget=None, block=8, lookup=False):
    cfg = GenerationConfig(max_new_tokens=n, block_size=block, stop_token_ids=(), lookup=lookup, tree_budget=budget)
    return engine.generate(prompt, cfg)


def test_a_tree_grows_by_expected_value_and_a_chain_is_rank_zero():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [3.0, 0.0, 2.0, 9.0], [1.0, 2.0, 3.0, 4.0]])  # [B-1, V]
    rates = TreeRates()
    chain = build_tree(logits, anchor=0, budget=4, rates=rates, width=1)
    assert chain.tokens == [0, 1, 3, 3] and chain.parents == [-1, 0, 1, 2] and set(chain.ranks) == {0}
    tree = build_tree(logits, anchor=0, budget=6, rates=rates, width=3)
    assert len(tree) == 6 and tree.parents[1] == 0 and tree.tokens[1] == 1  # the argmax first
    assert all(tree.parents[i] < i for i in range(1, 6))  # a parent precedes its children
    assert all(tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in range(1, 6))
    mask = tree.attention_mask()
    for i in range(6):  # a node sees exactly itself and its ancestors
        seen, j = set(), i
        while j >= 0:
            seen.add(j)
            j = tree.parents[j]
        assert {j for j in range(6) if mask[i, j]} == seen


def test_rates_learn_from_verdicts():
    rates = TreeRates()
    tree = Tree([0, 1, 2, 3], [-1, 0, 0, 1], [0, 1, 1, 2], [0, 0, 1, 0])
    before = rates.rate(1, 1)
    for _ in range(20):
        rates.update(tree, [0, 2])  # rank 1 at depth 1 accepted, rank 0 rejected; depth 2 never tried
    assert rates.rate(1, 1) > before and rates.rate(1, 0) < 0.1 and (2, 0) not in rates.tried


def test_greedy_walk_takes_the_child_with_the_targets_token():
    tree = Tree([9, 4, 5, 6, 7], [-1, 0, 0, 2, 2], [0, 1, 1, 2, 2], [0, 0, 1, 0, 1])
    target_argmax = {0: 5, 2: 7, 4: 1}  # after node 0 the target says 5 (node 2), then 7 (node 4), then 1
    v = verify_tree_greedy(tree, lambda i: target_argmax[i])
    assert v.path == [0, 2, 4] and v.next_token == 1 and v.num_accepted == 2


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("budget", [1, 2, 5, 12, 32])
def test_tree_greedy_equals_plain_decoding(kind, budget):
    target = tiny_target(kind)
    plain = Engine(target)
    for prompt in PROMPTS:
        expected = greedy(plain, prompt).token_ids
        for draft in (tiny_draft(target, block_size=8),
                      OracleDraft(tiny_draft(target, block_size=8), expected, len(prompt), 0.6, seed=3)):
            for lookup in (False, True):
                got = greedy(Engine(target, draft), prompt, budget=budget, lookup=lookup)
                assert got.token_ids == expected, (budget, lookup)


def test_an_oracle_tree_accepts_whole_paths():
    target = tiny_target("llama")
    prompt = PROMPTS[1]
    expected = greedy(Engine(target), prompt, n=60).token_ids
    oracle = OracleDraft(tiny_draft(target, block_size=8), expected, len(prompt), 1.0, seed=3)
    got = greedy(Engine(target, oracle), prompt, n=60, budget=16)
    assert got.token_ids == expected and max(got.stats.acceptance_lengths) == 8


def test_the_cache_after_a_tree_step_equals_a_fresh_prefill():
    """Compacting to the accepted path leaves exactly the committed sequence's keys and values."""
    target = tiny_target("qwen3")
    prompt = PROMPTS[1]
    draft = tiny_draft(target, block_size=8)
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), cache, logits_at=1)
    logits = torch.randn(7, target.vocab_size)
    tree = build_tree(logits, anchor=7, budget=12, rates=TreeRates(), width=3)
    with torch.inference_mode():
        out = target.forward(torch.tensor([tree.tokens]), cache, tree=tree)
        path = [0] + [c for c in tree.children(0)][:1]
        path += tree.children(path[-1])[:1]
        target.keep_path(cache, len(prompt), path)
        committed = prompt + [tree.tokens[i] for i in path]
        fresh = target.new_cache()
        target.forward(torch.tensor([committed]), fresh, logits_at=1)
        for a, b in zip(cache.kv.layers, fresh.kv.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
        nxt = torch.tensor([[3]])
        torch.testing.assert_close(target.forward(nxt, cache).logits, target.forward(nxt, fresh).logits,
                                   rtol=1e-5, atol=1e-5)
        # the tree forward's node logits are each path's own
        for i in path:
            j, toks = i, []
            while j >= 0:
                toks.append(tree.tokens[j])
                j = tree.parents[j]
            alone = target.model(torch.tensor([prompt + toks[::-1]])).logits[0, -1]
            torch.testing.assert_close(out.rows(i, i + 1)[0], alone, rtol=1e-4, atol=1e-4)
    assert draft is not None


def test_trees_are_refused_where_they_cannot_run():
    target = tiny_target("llama")
    engine = Engine(target, tiny_draft(target))
    from blockdraft.verify import SamplingParams

    with pytest.raises(BlockdraftError, match="greedy only"):
        engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=4, tree_budget=8,
                                                    sampling=SamplingParams(temperature=1.0)))
    with pytest.raises(BlockdraftError, match="tree_budget"):
        engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=4, tree_budget=0))
    hybrid = tiny_family("qwen3.5")
    with pytest.raises(BlockdraftError, match="plain attention"):
        Engine(hybrid, tiny_draft(hybrid)).generate([1, 2, 3], GenerationConfig(max_new_tokens=4, tree_budget=8))
