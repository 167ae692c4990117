"""Several sequences decoded together (decoding.Batch over slots.SlotCache): every request's
output is the one it gets alone, whatever joins, stops or leaves beside it."""

import random

import pytest
import torch

from blockdraft.decoding.adaptive import AdaptiveBlockPolicy, SequenceRates, load_policy
from blockdraft.decoding.engine import Engine, GenerationConfig, GenerationStats
from blockdraft.errors import BlockdraftError
from blockdraft.decoding.slots import RowBlock, SlotCache
from blockdraft.decoding.verify import SamplingParams, probs_from_logits

from conftest import VOCAB, tiny_draft, tiny_target
from test_sampling import total_variation


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths; some repeat themselves, so prompt lookup finds continuations."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(2, 12))]
        out.append(base * (1 + i % 3))
    return out


def drive(engine: Engine, requests: list[tuple[list[int], GenerationConfig]], join_at: list[int],
          cancel: dict[int, int] | None = None, max_step_tokens: int | None = None) -> dict[int, list[int]]:
    """Run requests through one batch: request i joins before step join_at[i], and leaves (is
    cancelled) before step cancel[i]; the tokens each got."""
    cancel = cancel or {}
    batch = engine.batch(max_step_tokens)
    tokens: dict[int, list[int]] = {}
    seqs = {}
    step = 0
    while len(seqs) < len(requests) or batch.sequences:
        for i, (prompt, cfg) in enumerate(requests):
            if join_at[i] == step:
                seqs[i], first = batch.join(prompt, cfg, GenerationStats())
                tokens[i] = list(first.tokens)
        for i, at in cancel.items():
            if at == step and seqs[i] in batch.sequences:
                batch.leave(seqs[i])
        if batch.sequences:
            index = {id(s): i for i, s in seqs.items()}
            for seq, st in batch.step():
                tokens[index[id(seq)]] += st.tokens
        step += 1
    return tokens


def test_slot_rows_compute_what_caches_of_their_own_do():
    """Ragged blocks, a tree, holes, compaction and a row leaving: each row's logits equal those
    of the same tokens through a cache of its own."""
    from blockdraft.decoding.tree import Tree

    target = tiny_target("llama")
    slots, own = SlotCache(), []
    for p in ([1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]):
        for caches in (None, own):
            c = target.new_cache()
            target.forward(torch.tensor([p]), c, logits_at=1)
            target.rollback(c, len(p))
            slots.join(c) if caches is None else caches.append(c)
    tree = Tree(tokens=[40, 41, 42, 43], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2], ranks=[0, 0, 1, 0])
    rounds = [([RowBlock([20, 21, 22]), RowBlock([30]), RowBlock([40, 41, 42, 43], tree)], [[0, 1], [0], [0, 2]]),
              ([RowBlock([50]), RowBlock([51, 52, 53, 54]), RowBlock([55, 56])], [[0], [0, 1, 2], [0]])]
    with torch.inference_mode():
        for blocks, kept in rounds:
            out = slots.forward(target, blocks, None)
            for r, (b, c, mine) in enumerate(zip(blocks, own, out.sequences(2))):
                start = c.get_seq_length()
                want = target.forward(torch.tensor([b.ids]), c, tree=b.tree).logits[0]
                assert torch.allclose(mine.rows(0, len(b.ids)), want, atol=1e-5)
                assert torch.allclose(mine.rows(0, 1), want[:1], atol=1e-5)
                if b.tree is None:
                    target.rollback(c, start + len(kept[r]))
                else:
                    target.keep_path(c, start, kept[r])
            slots.keep(kept)
            assert slots.lengths == [c.get_seq_length() for c in own]
        slots.leave(1)
        del own[1]
        out = slots.forward(target, [RowBlock([60, 61]), RowBlock([62])], None)
        for ids, c, mine in zip(([60, 61], [62]), own, out.sequences(1)):
            want = target.forward(torch.tensor([ids]), c).logits[0]
            assert torch.allclose(mine.rows(0, len(ids)), want, atol=1e-5)
        slots.keep([[0, 1], [0]])
        slots.compact()
        assert slots.slots == max(slots.lengths) and slots.valid.sum(1).tolist() == slots.lengths


def test_slots_append_in_place_what_concatenation_would_hold():
    """The slot cache's layers append into spare room (no copy of the cache per step) and hold,
    after joins, ragged steps, holes, compaction and a leave, exactly what transformers' own
    concatenating layers hold."""
    target = tiny_target("llama")
    fast, plain = SlotCache(), SlotCache()
    for slots in (fast, plain):
        for p in ([1, 2, 3, 4, 5], [7, 8, 9]):
            c = target.new_cache()
            target.forward(torch.tensor([p]), c, logits_at=1)
            target.rollback(c, len(p))
            slots.join(c)
    from transformers.cache_utils import DynamicLayer

    for i, layer in enumerate(plain.kv.layers):  # transformers' own layers: concatenation
        plain.kv.layers[i] = DynamicLayer()
        plain.kv.layers[i].__dict__.update(layer.__dict__)
    assert all(type(a).__name__ == "SlotLayer" for a in fast.kv.layers)

    def run(slots, blocks, kept):
        slots.forward(target, [RowBlock(b) for b in blocks], None)
        slots.keep(kept)

    def same():
        for a, b in zip(fast.kv.layers, plain.kv.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(fast.valid, plain.valid)

    with torch.inference_mode():
        steps = [([[20, 21, 22], [30]], [[0, 1], [0]]), ([[23], [31, 32, 33]], [[0], [0, 1, 2]]),
                 ([[24, 25], [34]], [[0], [0]]), ([[26], [35]], [[0], [0]])]
        for i, (blocks, kept) in enumerate(steps):
            for slots in (fast, plain):
                run(slots, blocks, kept)
            same()
            buffer = fast.kv.layers[0].buffer[0].data_ptr()
            if i:
                assert buffer == last  # appended in place: the same storage as the step before
            last = buffer
            assert fast.kv.layers[0].keys.data_ptr() == buffer
        for slots in (fast, plain):
            slots.compact()
            slots.leave(0)
            run(slots, [[40, 41]], [[0, 1]])
            run(slots, [[42]], [[0]])
        same()


@pytest.mark.parametrize("mode", ["plain", "chain8", "adaptive", "tree6"])
@pytest.mark.parametrize("n", [2, 5, 16])
def test_batched_greedy_equals_each_request_alone(mode, n):
    """2..16 requests with mixed prompts, lengths, stop tokens and arrival steps, one cancelled
    mid-batch: each request's tokens are those it gets decoded alone."""
    target = tiny_target("llama" if n != 5 else "qwen3")
    draft = None if mode == "plain" else tiny_draft(target, block_size=8)
    engine = Engine(target, draft)
    requests = []
    for i, p in enumerate(prompts(n, seed=n)):
        cfg = GenerationConfig(max_new_tokens=[24, 9, 40, 3][i % 4], lookup=i % 2 == 0,
                               stop_token_ids=(5, 17) if i % 3 == 1 else (),
                               block_size=8 if mode in ("chain8", "tree6") else None,
                               tree_budget=6 if mode == "tree6" else None)
        requests.append((p, cfg))
    alone = [engine.generate(p, cfg).token_ids for p, cfg in requests]
    join_at = [0 if i < n // 2 else 1 + 2 * i for i in range(n)]
    got = drive(engine, requests, join_at, cancel={1: 4})
    for i in range(n):
        if i == 1:  # cancelled: what it got so far is the start of its output
            assert got[i] == alone[i][: len(got[i])]
        else:
            assert got[i] == alone[i], f"request {i}"


def test_the_drafter_runs_once_per_step_for_every_sequence_that_drafts():
    target = tiny_target("llama")
    engine = Engine(target, tiny_draft(target, block_size=8))
    calls = []
    for name in ("blocks_hidden", "block_hidden"):
        original = getattr(engine.draft, name)
        setattr(engine.draft, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    batch = engine.batch()
    cfg = GenerationConfig(max_new_tokens=30, lookup=False, block_size=8, stop_token_ids=())
    for p in prompts(4, seed=3):
        batch.join(p, cfg, GenerationStats())
    batched = 0
    while batch.sequences:
        before = len(calls)
        blocks = {st.num_drafted for _, st in batch.step() if st.num_drafted}
        assert len(calls) - before == len(blocks)  # one draft forward per block size, not per sequence
        batched += calls[before:].count("blocks_hidden")
    assert batched > 0


def test_a_request_that_fails_its_checks_never_disturbs_the_batch():
    target = tiny_target("llama")
    engine = Engine(target, tiny_draft(target))
    requests = [(p, GenerationConfig(max_new_tokens=20, stop_token_ids=())) for p in prompts(3)]
    alone = [engine.generate(p, cfg).token_ids for p, cfg in requests]
    batch = engine.batch()
    seqs, tokens = [], {}
    for p, cfg in requests:
        seq, first = batch.join(p, cfg, GenerationStats())
        seqs.append(seq)
        tokens[id(seq)] = list(first.tokens)
    for seq, st in batch.step():
        tokens[id(seq)] += st.tokens
    for bad in ([], [VOCAB + 3], [1] * 300):
        with pytest.raises(BlockdraftError):
            batch.join(bad, GenerationConfig(max_new_tokens=5), GenerationStats())
    with pytest.raises(BlockdraftError):
        batch.join([1, 2], GenerationConfig(max_new_tokens=0), GenerationStats())
    assert len(batch.sequences) == 3
    while batch.sequences:
        for seq, st in batch.step():
            tokens[id(seq)] += st.tokens
    assert [tokens[id(s)] for s in seqs] == alone


def test_batched_sampling_keeps_the_target_distribution():
    """The joint law of the first two new tokens, requests decoded 6 at a time (adaptive blocks,
    the batch's choice, unseeded), equals the target's exact one."""
    target = tiny_target("llama", vocab=8, layers=3)
    engine = Engine(target, tiny_draft(target, block_size=4))
    sp = SamplingParams(temperature=1.5, top_k=5)
    prompt = [1, 2, 3]
    with torch.inference_mode():
        p1 = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1], sp)
        exact = torch.zeros(8, 8)
        for a in range(8):
            if p1[a] > 0:
                exact[a] = p1[a] * probs_from_logits(target.model(torch.tensor([prompt + [a]])).logits[0, -1], sp)
    counts = torch.zeros(8, 8)
    cfg = GenerationConfig(max_new_tokens=2, stop_token_ids=(), sampling=sp)
    for _ in range(500):
        got = drive(engine, [(prompt, cfg)] * 6, [0] * 6)
        for a, b in got.values():
            counts[a, b] += 1
    assert total_variation(counts.flatten(), exact.flatten()) < 0.07


def test_the_load_policy_speculates_wide_alone_and_narrows_under_load():
    """Step cost c(B, k) = 1 + 0.1 B k (one forward of B blocks of k), acceptance 0.8 per draft:
    learned online from those costs (no table), the block chosen is within 5% of the best rate
    at every batch size, and the best narrows from 7 alone to 3 at 8 sequences and to plain
    steps at 64."""
    rng = random.Random(0)
    policies: dict = {}
    chain = policies.setdefault(16, AdaptiveBlockPolicy(16))

    def cost(batch, k):
        return 1 + 0.1 * batch * k

    def true_rate(batch, k):
        return sum(0.8 ** j for j in range(k)) / cost(batch, k)

    chosen = {}
    for batch in (1, 8, 64):
        policy = chain if batch == 1 else load_policy(policies, chain, batch)
        picks = []
        for _ in range(400):
            k = policy.choose()
            accepted = next((j for j in range(k - 1) if rng.random() > 0.8), k - 1)
            policy.learn(k, accepted)
            policy.record(k, accepted, cost(batch, k))
            picks.append(k)
        chosen[batch] = max(set(picks[-100:]), key=picks[-100:].count)
        best = max(range(1, 17), key=lambda k: true_rate(batch, k))
        assert true_rate(batch, chosen[batch]) >= 0.95 * true_rate(batch, best), (batch, chosen, best)
    assert [max(range(1, 17), key=lambda k: true_rate(b, k)) for b in (1, 8, 64)] == [7, 3, 1]
    assert chosen[1] > chosen[8] > chosen[64] == 1, chosen
    # a new batch size starts from its neighbour's costs: no first step of full blocks
    assert load_policy(policies, chain, 9).choose() == load_policy(policies, chain, 8).choose() < 16


def test_a_batch_block_follows_what_its_own_sequences_accept():
    """Four sequences in a batch, the cost c(k) = 1 + 0.1 k: sequences that accept 90% of their
    drafts get a wide block, sequences that accept none plain steps, a mix in between, whatever
    the engine's shared rates say (both start from the same ones)."""
    rng = random.Random(0)
    policies: dict = {}
    chain = policies.setdefault(16, AdaptiveBlockPolicy(16))
    load = load_policy(policies, chain, 4)
    load.cost = {k: 1 + 0.1 * k for k in range(1, 17)}

    def sequence(accept: float) -> SequenceRates:
        own = SequenceRates(16, prior=chain.alphas())
        for _ in range(100):
            own.learn(16, next((j for j in range(15) if rng.random() > accept), 15))
        return own

    def choice(rates: list[SequenceRates]) -> int:
        load.plan([sum(r.expected_tokens(b) for r in rates) / len(rates) for b in range(1, 17)])
        load.steps_since_probe = 0  # the choice itself, not a probe
        return load.choose()

    good, bad = [sequence(0.9) for _ in range(4)], [sequence(0.0) for _ in range(4)]
    wide, mixed, plain = choice(good), choice(good[:2] + bad[:2]), choice(bad)
    assert wide > mixed > plain == 1, (wide, mixed, plain)


def test_a_batch_policy_chooses_whatever_its_neighbour_has_measured():
    """A batch forms after the chain measured only some blocks (or none): the choice is a block,
    never a failed comparison (regression: a step of 16 requests once failed here)."""
    for measured in ({}, {16: 2.0}, {16: 2.0, 1: 1.0}, {1: 1.0}, {4: 1.5}):
        policies: dict = {}
        chain = policies.setdefault(16, AdaptiveBlockPolicy(16))
        chain.cost.update(measured)
        for batch in (2, 3, 16):
            policy = load_policy(policies, chain, batch)
            for _ in range(20):
                k = policy.choose()
                assert 1 <= k <= 16
                policy.record(k, 0, 1.0 + 0.01 * batch * k)


@pytest.mark.parametrize("trees", [None, "auto"])  # chains, and the default's trees
def test_max_step_tokens_caps_a_batch_step(trees):
    target = tiny_target("llama")
    engine = Engine(target, tiny_draft(target, block_size=8))
    seen = []
    forward = target.forward

    def spy(ids, *args, **kwargs):
        seen.append(tuple(ids.shape))
        return forward(ids, *args, **kwargs)

    target.forward = spy
    requests = [(p, GenerationConfig(max_new_tokens=12, stop_token_ids=(), lookup=False, tree_budget=trees))
                for p in prompts(4)]
    drive(engine, requests, [0] * 4, max_step_tokens=8)
    batched = [s for s in seen if s[0] > 1]
    assert batched and all(b * t <= 8 for b, t in batched)
