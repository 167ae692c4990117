"""Token trees (tree.py): built by expected value, with a lookup branch, verified in one target
forward under a 4D ancestor mask, the cache compacted to the accepted path; greedy output equals
plain decoding, and sampling keeps the target's distribution (total-variation tests)."""

import pytest
import torch

from blockdraft.decoding.engine import Engine, GenerationConfig, GenerationStats
from blockdraft.errors import BlockdraftError
from blockdraft.decoding.oracle import OracleDraft
from blockdraft.decoding.tree import LOOKUP, Tree, TreeRates, build_tree, draft_candidates, plan_trees, truncate
from blockdraft.decoding.verify import SamplingParams, verify_tree_greedy, verify_tree_sampled

from conftest import tiny_draft, tiny_target
from test_adaptive import SimulatedClock
from test_sampling import total_variation
from families import SLIDING, STATEFUL, SUPPORTED, tiny_family

PROMPTS = [[5, 17, 33, 2], list(range(3, 40))]


def greedy(engine, prompt, n=40, budget=None, block=8, lookup=False):
    cfg = GenerationConfig(max_new_tokens=n, block_size=block, stop_token_ids=(), lookup=lookup, tree_budget=budget)
    return engine.generate(prompt, cfg)


def test_a_tree_grows_by_expected_value_and_a_chain_is_rank_zero():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [3.0, 0.0, 2.0, 9.0], [1.0, 2.0, 3.0, 4.0]])  # [B-1, V]
    rates = TreeRates()
    chain = build_tree(draft_candidates(logits, 1, False), anchor=0, budget=4, rates=rates)
    assert chain.tokens == [0, 1, 3, 3] and chain.parents == [-1, 0, 1, 2] and set(chain.ranks) == {0}
    tree = build_tree(draft_candidates(logits, 3, False), anchor=0, budget=6, rates=rates)
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
def test_tree_greedy_equals_plain_decoding_for_every_budget(kind):
    """Budgets 1..32 (every one on Llama, a spread on Qwen3), oracle and random drafters, with and
    without a lookup branch (the prompt repeats itself, so the branch is used), fixed and adaptive."""
    target = tiny_target(kind)
    prompt = [5, 17, 33, 2, 8, 5, 17, 33, 2, 8, 5, 17]
    expected = greedy(Engine(target), prompt, n=32).token_ids
    random_draft = tiny_draft(target, block_size=8)
    oracle = OracleDraft(tiny_draft(target, block_size=8), expected, len(prompt), 0.6, seed=3)
    budgets = range(1, 33) if kind == "llama" else (1, 2, 5, 12, 32)
    for budget in budgets:
        for draft, lookup in ((oracle, False), (oracle, True), (random_draft, budget % 2 == 0)):
            got = greedy(Engine(target, draft), prompt, n=32, budget=budget, lookup=lookup)
            assert got.token_ids == expected, (budget, lookup)
    for lookup in (False, True):  # adaptive budgets up to 32
        got = greedy(Engine(target, oracle), prompt, n=32, budget=32, block=None, lookup=lookup)
        assert got.token_ids == expected, lookup


def test_adaptive_trees_verify_the_lookup_alone_where_it_pays():
    """With the tree's size adapting, a lone sequence's step may verify the prompt-lookup
    continuation alone, with no draft forward, as an adaptive chain's may: the target here
    repeats its prompt, the drafter is random, so the lookup pays and the drafter does not."""
    target = tiny_target("llama")
    prompt = list(range(3, 40)) * 2
    expected = greedy(Engine(target), prompt, n=48).token_ids
    draft = tiny_draft(target, block_size=8)
    engine = Engine(target, draft, clock=SimulatedClock(target, draft))  # the same costs on every run
    for _ in range(2):  # the engine keeps its policies: the second request starts from what the first learned
        got = greedy(engine, prompt, n=48, budget=16, block=None, lookup=True)
        assert got.token_ids == expected
    assert got.stats.lookup_steps > 0 and got.stats.tau > 2
    assert len(got.stats.tree_sizes) < len(got.stats.acceptance_lengths)  # not every step was a tree


def test_a_lookup_branch_joins_the_tree_and_merges_with_an_equal_candidate():
    cands = [[4, 5], [6, 7], [8, 9]]  # [depth - 1][rank]
    tree = build_tree(cands, anchor=1, budget=12, rates=TreeRates(), lookup=[5, 3, 2])
    # the lookup's first token is the drafter's rank-1 candidate at depth 1: one node, the chain goes on below it
    five = next(i for i in range(1, len(tree)) if tree.tokens[i] == 5 and tree.parents[i] == 0)
    three = next(i for i in range(len(tree)) if tree.tokens[i] == 3)
    assert tree.parents[three] == five and tree.ranks[three] == LOOKUP and tree.depths[three] == 2
    assert sum(1 for c in tree.children(0) if tree.tokens[c] == 5) == 1
    # unmerged (sampled candidates): the lookup is a separate child, verified first
    apart = build_tree(cands, anchor=1, budget=12, rates=TreeRates(), lookup=[5, 3, 2], merge=False)
    kids = apart.children(0)
    assert apart.ranks[kids[0]] == LOOKUP and [apart.tokens[c] for c in kids].count(5) == 2


def test_plans_give_the_expected_tokens_and_drafted_depth_of_the_best_trees():
    rates = TreeRates()
    for _ in range(30):  # rank 0 at depth 1 accepted 90%
        rates.update(Tree([0, 1, 2], [-1, 0, 0], [0, 1, 1], [0, 0, 1]), [0, 1] if _ % 10 else [0])
    shape = plan_trees(rates, depth=7, budget=16, lookup=3)
    plan = shape.expected
    assert plan[0] == 1.0 and all(b >= a for a, b in zip(plan, plan[1:]))
    assert shape.drafter_depth[0] == 0 and shape.drafter_depth[-1] <= 7
    tree = build_tree([[10 + 4 * d + r for r in range(4)] for d in range(7)], 0, 16, rates, lookup=[1, 2, 3],
                      merge=False)
    for n in (1, 4, 16):
        assert truncate(tree, n).expected_tokens() == pytest.approx(plan[n - 1])
        assert max([d for d, r in zip(tree.depths[:n], tree.ranks[:n]) if r != LOOKUP], default=0) == \
            shape.drafter_depth[n - 1]
    assert plan[1] == pytest.approx(1 + rates.rate(1, 0))  # the best second node: depth 1's first candidate


def test_the_budget_policy_grows_trees_for_a_good_drafter_and_drops_them_for_a_useless_one():
    target = tiny_target("llama")
    prompt = PROMPTS[1]
    expected = greedy(Engine(target), prompt, n=120).token_ids
    good = OracleDraft(tiny_draft(target, block_size=8), expected, len(prompt), 0.8, seed=2)
    engine = Engine(target, good, clock=SimulatedClock(target, good))
    got = greedy(engine, prompt, n=120, budget=24, block=None)
    assert got.token_ids == expected and got.stats.tree_sizes and sum(got.stats.tree_sizes[-5:]) / 5 > 4
    useless = tiny_draft(target, block_size=8)  # random: accepts ~nothing
    engine = Engine(target, useless, clock=SimulatedClock(target, useless))
    got = greedy(engine, prompt, n=120, budget=24, block=None)
    assert got.token_ids == expected and len(got.stats.tree_sizes) < 20  # mostly plain steps, a few probes


def test_an_oracle_tree_accepts_whole_paths():
    target = tiny_target("llama")
    prompt = PROMPTS[1]
    expected = greedy(Engine(target), prompt, n=60).token_ids
    oracle = OracleDraft(tiny_draft(target, block_size=8), expected, len(prompt), 1.0, seed=3)
    got = greedy(Engine(target, oracle), prompt, n=60, budget=16)
    assert got.token_ids == expected and max(got.stats.acceptance_lengths) == 8


@pytest.mark.parametrize("pick", [0, -1])
def test_the_cache_after_a_tree_step_equals_a_fresh_prefill(pick):
    """Compacting to the accepted path leaves exactly the committed sequence's keys and values:
    a path of the first nodes (a crop) and one of later nodes (entries moved)."""
    target = tiny_target("qwen3")
    prompt = PROMPTS[1]
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), cache, logits_at=1)
    logits = torch.randn(7, target.vocab_size)  # a drafter's, for 7 block positions
    tree = build_tree(draft_candidates(logits, 3, False), anchor=7, budget=12, rates=TreeRates())
    with torch.inference_mode():
        out = target.forward(torch.tensor([tree.tokens]), cache, tree=tree)
        if pick == 0:  # nodes 0, 1, ... while each is the previous one's child
            path = [0]
            while len(path) < len(tree) and tree.parents[len(path)] == path[-1]:
                path.append(len(path))
        else:  # the last child of the root, then its last child
            path = [0, tree.children(0)[-1]]
            path += tree.children(path[-1])[-1:]
        assert len(path) >= 2 and (path == list(range(len(path)))) == (pick == 0)
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


def test_trees_are_refused_where_they_cannot_run():
    target = tiny_target("llama")
    engine = Engine(target, tiny_draft(target))
    with pytest.raises(BlockdraftError, match="tree_budget"):
        engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=4, tree_budget=0))
    hybrid = tiny_family("qwen3.5")
    with pytest.raises(BlockdraftError, match="plain attention"):
        Engine(hybrid, tiny_draft(hybrid)).generate([1, 2, 3], GenerationConfig(max_new_tokens=4, tree_budget=8))


# --- sampling (T > 0): multi-candidate rejection sampling over the siblings of each node ---

V_TOY, L_TOY = 4, 3


def toy_p(context: tuple) -> torch.Tensor:
    """A toy target: a fixed distribution over 4 tokens for every context (sharp and varied)."""
    g = torch.Generator().manual_seed(hash(context) % (2**31))
    return torch.softmax(2.0 * torch.randn(V_TOY, generator=g), -1)


def exact_joint() -> torch.Tensor:
    joint = torch.zeros([V_TOY] * L_TOY)
    for idx in torch.cartesian_prod(*[torch.arange(V_TOY)] * L_TOY).tolist():
        prob, ctx = 1.0, ()
        for t in idx:
            prob *= float(toy_p(ctx)[t])
            ctx += (t,)
        joint[tuple(idx)] = prob
    return joint


def sample_toy(draws: int, sampled: bool, lookup: bool, wrong_rule: bool = False, seed: int = 0) -> torch.Tensor:
    """The first 3 tokens of `draws` generations by tree steps of 8 nodes over a 3-deep block."""
    from blockdraft.decoding import verify as verify_mod

    gen = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(3, V_TOY, generator=torch.Generator().manual_seed(99)), -1)  # [D, V] far from p
    rates = TreeRates()
    proposal = verify_mod._proposal
    if wrong_rule:  # forget that later siblings were drawn without the earlier ones
        verify_mod._proposal = lambda t, c: None if t.q is None or t.ranks[c] == LOOKUP else t.q[t.depths[c] - 1]
    counts = torch.zeros([V_TOY] * L_TOY)
    try:
        for _ in range(draws):
            out: list[int] = []
            while len(out) < L_TOY:
                cands = draft_candidates(q, 3, True, gen) if sampled else draft_candidates(q, 3, False)
                branch = [(len(out) + k) % V_TOY for k in range(3)] if lookup else []
                tree = build_tree(cands, -1, 8, rates, branch, merge=not sampled, q=q if sampled else None)

                def p_at(i, tree=tree, out=out):
                    toks = []
                    while i > 0:
                        toks.append(tree.tokens[i])
                        i = tree.parents[i]
                    return toy_p(tuple(out + toks[::-1]))

                v = verify_tree_sampled(tree, p_at, gen)
                rates.update(tree, v.path)
                out += [tree.tokens[i] for i in v.path[1:]] + [v.next_token]
            counts[tuple(out[:L_TOY])] += 1
    finally:
        verify_mod._proposal = proposal
    return counts


@pytest.mark.parametrize("sampled,lookup", [(True, False), (False, False), (True, True), (False, True)])
def test_tree_sampling_preserves_the_target_distribution(sampled, lookup):
    """The joint law of the first three committed tokens equals the target's, computed exactly,
    for candidates drawn from q without replacement and for q's top tokens (one-hot proposals),
    with and without a lookup branch; trees of 8 nodes, q far from p, rates learned on the way."""
    counts = sample_toy(12000, sampled, lookup)
    # 12000 draws over 64 outcomes: sampling noise gives TV ~0.03
    assert total_variation(counts.flatten(), exact_joint().flatten()) < 0.05


def test_tree_tv_detects_a_wrong_rule():
    """The statistic can fail: treating every sibling as drawn from the whole q biases the law."""
    counts = sample_toy(12000, True, False, wrong_rule=True)
    assert total_variation(counts.flatten(), exact_joint().flatten()) > 0.1  # measured: 0.19


def test_a_seed_makes_tree_sampling_reproducible_across_requests():
    """Rates learned by one request must not change another's draws: a seeded request starts fresh."""
    from blockdraft.decoding.verify import SamplingParams

    target = tiny_target("qwen3")
    engine = Engine(target, tiny_draft(target))
    cfg = GenerationConfig(max_new_tokens=24, stop_token_ids=(), tree_budget=12,
                           sampling=SamplingParams(1.0, 0, 0.9, seed=7))
    first = engine.generate([4, 5, 6], cfg)
    engine.generate([9, 9, 9, 9], GenerationConfig(max_new_tokens=24, stop_token_ids=(), tree_budget=12,
                                                   sampling=SamplingParams(1.0)))  # unseeded, adaptive
    assert engine.generate([4, 5, 6], cfg).token_ids == first.token_ids and first.stats.tree_sizes


def test_the_drafters_confidence_shapes_each_trees_nodes():
    """A candidate's rate is its (depth, confidence bin)'s once that bin has verdicts: with the
    same candidates, a step where the drafter is sure of position 1 grows the tree deep, a step
    where it is not grows it wide; a bin without verdicts ranks as its (depth, rank)."""
    rates = TreeRates()
    cands = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    assert rates.rate(1, 0, 0.97) == rates.rate(1, 0) and rates.rate(2, 1, 0.3) == rates.rate(2, 1)
    sure = [[0.97, 0.01, 0.01, 0.01]] * 3
    unsure = [[0.35, 0.33, 0.31, 0.01]] * 3
    for step in range(60):  # verdicts: a sure first candidate is right; unsure ones, half the time at depth 1, never deeper
        rates.update(Tree([0, 10, 11, 20, 21, 30], [-1, 0, 0, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 0, 1, 0, 1, 0],
                          confidence=sure), [0, 1, 3, 5])
        rates.update(Tree([0, 10, 11, 20], [-1, 0, 0, 1], [0, 1, 1, 2], [0, 0, 1, 0], confidence=unsure),
                     [0, 1 + step % 2])
    assert rates.rate(1, 0, 0.97) > 0.9 > 0.6 > rates.rate(1, 0, 0.35) > 0.3 > 0.1 > rates.rate(2, 0, 0.35)
    deep = build_tree(cands, 0, 4, rates, confidence=sure)
    wide = build_tree(cands, 0, 4, rates, confidence=unsure)
    assert deep.tokens == [0, 10, 20, 30] and deep.depths == [0, 1, 2, 3]
    assert wide.tokens == [0, 10, 11, 12] and wide.depths == [0, 1, 1, 1]
    assert wide.confidence is unsure and truncate(wide, 2).confidence is unsure


def test_after_the_draft_a_lone_sequences_tree_is_cut_at_its_own_best_size():
    """The size planned before the draft (by ranks) is chosen again from the draft's own tree:
    more nodes where the drafter is sure, fewer where it is not; a size chosen to measure a cost
    (not the plan's best) stands."""
    from blockdraft.decoding.adaptive import TreeBudgetPolicy

    policy = TreeBudgetPolicy(8)
    for n, seconds in ((1, 1.0), (2, 1.2), (4, 1.6), (8, 3.0)):  # sizes 3, 5-7: on the line between
        for _ in range(3):
            policy.record(n, 0, seconds)
    policy.plan([1.0, 1.5, 1.9, 2.2, 2.4, 2.5, 2.6, 2.7])  # the average tree's expected tokens
    assert policy.choose() == 4  # 2.2 / 1.6 is the best rate
    assert policy.best_size([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], 4) == 8  # a sure draft
    assert policy.best_size([1.0, 1.3, 1.4, 1.45, 1.5, 1.5, 1.5, 1.5], 4) == 2  # an unsure one
    assert policy.best_size([1.0, 2.0, 3.0], 4) == 3  # never more than the tree's nodes
    assert policy.best_size([1.0, 1.3, 1.4, 1.45, 1.5, 1.5, 1.5, 1.5], 8) == 8  # a measure of c(8) stands


def test_the_default_is_trees_for_greedy_adaptive_decoding_and_chains_elsewhere():
    """A request (library, `generate`, `chat` and the server alike: `GenerationConfig.trees`)
    verifies trees of up to DEFAULT_TREE nodes unless told otherwise, where trees were measured
    ahead (greedy, adaptive blocks); chains at T > 0, at a fixed block, without a drafter and for
    a target that cannot keep a tree's path; `--tree 0` (None) asks for chains."""
    from blockdraft.cli.common import tree_option
    from blockdraft.decoding.state import DEFAULT_TREE

    def trees(tree=None, block=None, temperature=0.0, draft=True, supports=True):
        cfg = GenerationConfig(block_size=block, sampling=SamplingParams(temperature), tree_budget=tree_option(tree))
        return cfg.validate().trees(draft, supports)

    assert GenerationConfig().tree_budget == "auto" and trees() == DEFAULT_TREE
    assert trees(temperature=0.7) is None
    assert trees(block=4) is None
    assert GenerationConfig(adaptive=False).trees(True, True) is None  # the drafter's full block: a chain
    assert trees(draft=False) is None
    assert trees(supports=False) is None
    assert trees(0) is None
    assert trees(8, 4, 0.7) == 8
    for bad in (-1, 257):
        with pytest.raises(BlockdraftError, match="tree_budget"):
            trees(bad)


@pytest.mark.parametrize("family", [f for f in SUPPORTED if f not in STATEFUL + SLIDING])
def test_trees_are_exact_on_every_family_that_verifies_them(family):
    """Every plain-attention family verifies trees (the default for greedy decoding) and gets plain
    decoding's tokens, alone and in a batch. MLA's values have a head dim of their own, which the
    slot compaction once gathered with the keys' (a crash mid-decoding, issue 49)."""
    target = tiny_family(family)
    assert target.supports_trees
    prompts = [list(range(3, 30)), [5, 17, 33, 2, 8, 5, 17, 33, 2, 8, 5, 17]]
    expected = [greedy(Engine(target), p, n=30, block=1).token_ids for p in prompts]
    oracle = OracleDraft(tiny_draft(target, block_size=8), expected[0], len(prompts[0]), 0.6, seed=3)
    got = greedy(Engine(target, oracle), prompts[0], n=30, budget=16)
    assert got.token_ids == expected[0] and max(got.stats.acceptance_lengths) > 1
    cfg = GenerationConfig(max_new_tokens=30, block_size=8, stop_token_ids=(), lookup=True, tree_budget=16)
    batch = Engine(target, tiny_draft(target, block_size=8)).batch()
    seqs, tokens = [], {}
    for p in prompts:
        seq, first = batch.join(p, cfg, GenerationStats())
        seqs.append(seq)
        tokens[id(seq)] = list(first.tokens)
    while batch.sequences:  # rejected slots become holes, and compaction moves K and V apart
        for seq, st in batch.step():
            tokens[id(seq)] += st.tokens
    assert [tokens[id(s)] for s in seqs] == expected
