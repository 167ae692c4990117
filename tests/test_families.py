"""Every model family DFlash drafters target: speculative output identical to plain greedy decoding
and to transformers' `generate`, the sampled distribution exact, and families whose cache cannot be
rolled back refused before any work (tests/families.py builds the tiny models)."""

import pytest
import torch

from blockdraft.models.cache import layer_kinds
from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.errors import BlockdraftError
from blockdraft.decoding.oracle import OracleDraft
from blockdraft.models.target import Target
from blockdraft.decoding.verify import SamplingParams, probs_from_logits

from conftest import tiny_draft
from families import REFUSED, REFUSED_BY_PROBE, SLIDING, STATEFUL, SUPPORTED, tiny_family, tiny_model
from test_sampling import total_variation

PROMPT = list(range(3, 30))  # 27 tokens: past the sliding windows (8) before decoding starts
N = 40
# (block size, oracle keep or None for a random drafter, lookup): blocks 2..16, zero / partial /
# full acceptance, the drafter alone and with prompt lookup
CASES = [(2, None, False), (16, None, True), (3, 0.0, False), (5, 0.6, True), (8, 0.6, False), (16, 1.0, False),
         (4, 1.0, True)]


def greedy(engine, block, lookup):
    cfg = GenerationConfig(max_new_tokens=N, block_size=block, stop_token_ids=(), lookup=lookup)
    return engine.generate(PROMPT, cfg)


@pytest.mark.parametrize("family", SUPPORTED)
def test_speculative_greedy_equals_plain_and_hf_generate(family):
    target = tiny_family(family)
    plain = greedy(Engine(target), 1, False).token_ids
    with torch.inference_mode():
        hf = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=N, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert plain == hf
    for block, keep, lookup in CASES:
        draft = tiny_draft(target, block_size=block)
        if keep is not None:
            draft = OracleDraft(draft, plain, len(PROMPT), keep, seed=3)
        got = greedy(Engine(target, draft), block, lookup)
        assert got.token_ids == plain, (block, keep, lookup)
        if keep == 1.0 and not lookup:
            assert max(got.stats.acceptance_lengths) == block  # full blocks were accepted


@pytest.mark.parametrize("family", STATEFUL)
def test_rollback_leaves_the_recurrent_state_of_plain_processing(family):
    """After a block of 6 with 2 kept, the cache holds exactly the state of running those tokens:
    the rejected ones left no trace (the kept ones run in when flushed, or with the next forward)."""
    target = tiny_family(family)
    prefix, kept, junk = PROMPT[:10], PROMPT[10:12], PROMPT[20:24]

    def prefilled():
        cache = target.new_cache()
        target.forward(torch.tensor([prefix]), cache, logits_at=1)
        target.rollback(cache, len(prefix))
        return cache

    want = prefilled()
    target.forward(torch.tensor([kept]), want, logits_at=1)
    target.rollback(want, len(prefix) + len(kept))
    got = prefilled()
    target.forward(torch.tensor([kept + junk]), got, logits_at=1)
    target.rollback(got, len(prefix) + len(kept))
    assert got.num_pending == len(kept) and got.get_seq_length() == want.get_seq_length()
    target.flush(got)
    assert got.num_pending == 0 and got.kv.get_seq_length() == want.kv.get_seq_length()
    compared = 0
    for a, b in zip(got.kv.layers, want.kv.layers):
        for name in ("conv_states", "recurrent_states", "keys", "values"):
            x, y = getattr(a, name, None), getattr(b, name, None)
            for u, v in (zip(x.values(), y.values()) if isinstance(x, dict) else [(x, y)]):
                if isinstance(u, torch.Tensor):
                    assert u.shape == v.shape and torch.equal(u, v), name
                    compared += 1
    assert compared > 0


@pytest.mark.parametrize("family", ["qwen3.5", "lfm2"])
def test_pending_tokens_run_with_the_next_forward_or_on_their_own(family):
    """Deferring the kept tokens to the next forward and running them at once (max_pending 0)
    give plain decoding's greedy output, and the deferral saves the replay forwards."""
    target = tiny_family(family)
    plain = greedy(Engine(target), 1, False).token_ids
    counts = []
    for max_pending in (0, 16):
        target.max_pending = max_pending
        oracle = OracleDraft(tiny_draft(target, block_size=8), plain, len(PROMPT), 0.6, seed=3)
        calls = []
        real = target.model.base_model.forward
        target.model.base_model.forward = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        try:
            got = greedy(Engine(target, oracle), 8, False)
        finally:
            del target.model.base_model.forward
        assert got.token_ids == plain
        counts.append(len(calls))
    assert counts[1] < counts[0]  # fewer target forwards when the kept tokens ride along


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next"])
def test_a_leaking_rollback_is_caught_by_the_probe(family, monkeypatch):
    """Without putting the snapshot back (the rejected tokens left in the state, as before) the engine must
    refuse the target instead of decoding it wrongly."""
    target = tiny_family(family)
    monkeypatch.setattr("blockdraft.models.target.restore", lambda kv, snap: None)  # states left as the block made them
    with pytest.raises(BlockdraftError, match="differ from plain decoding"):
        Engine(target)


def test_all_recurrent_and_cacheless_families_are_refused():
    for family in REFUSED:
        with pytest.raises(BlockdraftError, match=r"not supported.*(past_key_values|no attention)"):
            tiny_family(family)


@pytest.mark.parametrize("family", sorted(REFUSED_BY_PROBE))
def test_a_family_that_does_not_continue_exactly_is_refused_by_the_probe(family):
    target = tiny_family(family)
    with pytest.raises(BlockdraftError, match=REFUSED_BY_PROBE[family]):
        Engine(target, tiny_draft(target))


def test_a_cache_layer_of_unknown_kind_is_refused(monkeypatch):
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class OddLayer(DynamicLayer):  # a subclass may hold state that cropping K/V would not undo
        pass

    def odd_cache(self):
        cache = DynamicCache()
        cache.layers = [OddLayer() for _ in range(4)]
        return cache

    monkeypatch.setattr(Target, "new_kv_cache", odd_cache)
    with pytest.raises(BlockdraftError, match="OddLayer"):
        Target(tiny_model("llama"), None)


@pytest.mark.parametrize("family", SLIDING)
def test_sliding_window_is_cut_back_to_the_window_after_each_step(family):
    target = tiny_family(family)
    result = greedy(Engine(target, tiny_draft(target, block_size=8)), 8, False)
    assert result.num_new_tokens == N
    assert "sliding" in target.cache_kinds
    cache = target.new_cache()
    target.forward(torch.tensor([PROMPT]), cache, logits_at=1)
    target.rollback(cache, len(PROMPT) - 3)
    kv = cache.kv
    sliding = [layer for layer, kind in zip(kv.layers, layer_kinds(kv)) if kind == "sliding"]
    assert sliding and all(layer.keys.shape[-2] == layer.sliding_window - 1 for layer in sliding)
    assert cache.get_seq_length() == len(PROMPT) - 3


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3.5", "lfm2", "gpt-oss"])  # Gated DeltaNet, convolution, sliding window
def test_sampling_keeps_the_exact_distribution(family):
    """Hybrid and sliding-window families, after a prompt longer than the window: speculative
    sampling's joint law of the first two new tokens, and the law of the third (drawn after a
    rollback whenever the first block was cut short), equal the target's, enumerated exactly."""
    import transformers as tf

    from families import _config

    cfg = _config(family)
    cfg.vocab_size = 8
    torch.manual_seed(0)
    target = Target(tf.AutoModelForCausalLM.from_config(cfg).float().eval(), None)
    prompt = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # 11 tokens > the window of 8
    params = dict(temperature=1.5, top_k=5)
    sp = SamplingParams(**params)

    def p_next(ids):
        with torch.inference_mode():
            return probs_from_logits(target.model(torch.tensor([prompt + ids])).logits[0, -1], sp)

    p1, pair, third = p_next([]), torch.zeros(8, 8), torch.zeros(8)
    for a in range(8):
        if p1[a] > 0:
            pair[a] = p1[a] * p_next([a])
            for b in range(8):
                if pair[a, b] > 0:
                    third += pair[a, b] * p_next([a, b])
    engine = Engine(target, tiny_draft(target, block_size=4))
    seen_pair, seen_third = torch.zeros(8, 8), torch.zeros(8)
    for seed in range(1500):
        cfg = GenerationConfig(max_new_tokens=3, stop_token_ids=(), lookup=False,
                               sampling=SamplingParams(**params, seed=seed))
        a, b, c = engine.generate(prompt, cfg).token_ids
        seen_pair[a, b] += 1
        seen_third[c] += 1
    # 1500 draws: noise TV ~0.05 over <= 25 outcomes, ~0.03 over <= 8; a biased rule gives more
    assert total_variation(seen_pair.flatten(), pair.flatten()) < 0.1
    assert total_variation(seen_third, third) < 0.06


def test_drafter_geometry_follows_mla_heads_and_per_type_rope():
    from blockdraft.models.draft import build_draft_config

    mla = tiny_model("deepseek-v3").config
    cfg = build_draft_config(mla, num_layers=2, block_size=8)
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (64, 4, mla.v_head_dim)
    assert cfg.num_kv_heads == 4  # grouped K/V heads dividing the query heads (8 at Kimi-K2.5's 64)
    gemma = tiny_model("gemma3").config
    assert build_draft_config(gemma).rope_theta == gemma.rope_parameters["full_attention"]["rope_theta"]


def test_a_kimi_k25_drafter_has_z_labs_size():
    """Kimi-K2.5's geometry (DeepSeek-V3 MLA, hidden 7168, 64 heads, value heads of 128, YaRN):
    6 layers and 6 taps give z-lab's Kimi-K2.5-DFlash exactly, 3.48B parameters (6.48 GiB in bf16),
    with the target's YaRN RoPE and the taps it publishes."""
    import transformers as tf

    from blockdraft.models.draft import DraftModel, build_draft_config

    kimi = tf.DeepseekV3Config(hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                               num_attention_heads=64, num_key_value_heads=64, vocab_size=163840, kv_lora_rank=512,
                               q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                               max_position_embeddings=262144,
                               rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=64.0,
                                                    original_max_position_embeddings=4096, mscale=1.0,
                                                    mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))
    cfg = build_draft_config(kimi, num_layers=6, block_size=8, num_taps=6)
    assert cfg.target_layer_ids == [1, 12, 24, 35, 47, 58]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 8, 128)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 64.0
    with torch.device("meta"):
        n = DraftModel(cfg).num_parameters()
    assert round(n * 2 / 2**30, 2) == 6.48
