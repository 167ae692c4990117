"""What a forward call must not change: RoPE whose frequencies depend on the call's longest
position (`dynamic`, `longrope`) is kept within the context where it does not; a boolean tree or
slot mask reaches eager attention as 0 / -inf, and an attention implementation the engine does not
know verifies chains one sequence at a time; sampling never touches torch's global generator, and
a seeded request's text is the same alone and in a busy batch (issue 49)."""

import pytest
import torch
import transformers as tf
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from blockdraft.decoding.engine import Engine, GenerationConfig, GenerationStats
from blockdraft.decoding.oracle import OracleDraft
from blockdraft.decoding.verify import SamplingParams
from blockdraft.errors import BlockdraftError
from blockdraft.models.target import Target

from conftest import tiny_draft
from families import COMMON, tiny_family

PROMPT = list(range(3, 28))  # 25 tokens


def _greedy(engine, prompt, n, block=1, tree=None):
    cfg = GenerationConfig(max_new_tokens=n, block_size=block, stop_token_ids=(), lookup=False, tree_budget=tree)
    return engine.generate(prompt, cfg)


def _phi3_longrope(seed=0) -> Target:
    half = 8  # head_dim 16 / 2
    cfg = tf.Phi3Config(**COMMON, original_max_position_embeddings=32, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=32,
        short_factor=[1.0] * half, long_factor=[1.0 + 3 * i for i in range(half)]))
    torch.manual_seed(seed)
    return Target(tf.AutoModelForCausalLM.from_config(cfg).float().eval(), tokenizer=None, name="tiny-phi3-longrope")


def test_a_longrope_target_keeps_requests_where_its_rope_does_not_depend_on_the_call():
    target = _phi3_longrope()
    assert target.max_context == 32 and target.rope_limit.rope_type == "longrope"
    with pytest.raises(BlockdraftError, match="longrope"):
        _greedy(Engine(target), list(range(3, 40)), 4)
    # within the limit a straddling block cannot occur, and speculation equals plain decoding
    plain = _greedy(Engine(target), PROMPT, 20)
    assert len(plain.token_ids) == 32 - len(PROMPT)  # the budget stops at the limit
    oracle = OracleDraft(tiny_draft(target, block_size=8), plain.token_ids, len(PROMPT), 1.0, seed=3)
    assert _greedy(Engine(target, oracle), PROMPT, 20, block=8).token_ids == plain.token_ids


def test_why_longrope_is_limited_a_block_across_the_threshold_changes_its_rows():
    """The premise of the limit: lifted, a verify block that crosses `original_max_position_embeddings`
    gives logits other than one-token forwards (long factors for all its rows at once)."""
    target = _phi3_longrope()
    ids = torch.tensor([list(range(3, 3 + 36))])
    with torch.inference_mode():
        whole = target.model(ids[:, :36]).logits[0, 28:32]  # one call reaching past 32: long factors for all
        alone = target.model(ids[:, :32]).logits[0, 28:32]  # the same rows, a call that stays below
    assert not torch.allclose(whole, alone, atol=1e-4)


def test_dynamic_rope_is_limited_to_its_unscaled_context():
    cfg = tf.LlamaConfig(**{**COMMON, "max_position_embeddings": 48},
                         rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0))
    torch.manual_seed(0)
    target = Target(tf.AutoModelForCausalLM.from_config(cfg).float().eval(), tokenizer=None, name="tiny-dynamic")
    assert target.max_context == 48 and target.rope_limit.rope_type == "dynamic"
    plain = _greedy(Engine(target), PROMPT, 40)
    assert len(plain.token_ids) == 48 - len(PROMPT)
    oracle = OracleDraft(tiny_draft(target, block_size=16), plain.token_ids, len(PROMPT), 1.0, seed=3)
    assert _greedy(Engine(target, oracle), PROMPT, 40, block=16).token_ids == plain.token_ids


def _llama(attn: str) -> Target:
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**COMMON), attn_implementation=attn).float().eval()
    return Target(model, tokenizer=None, name=f"tiny-llama-{attn}")


def test_eager_attention_gets_an_additive_mask_for_trees_and_batches():
    target = _llama("eager")
    assert target.attention == "eager" and target.supports_trees
    prompts = [PROMPT, [5, 17, 33, 2, 8, 5, 17, 33, 2, 8, 5, 17]]
    expected = [_greedy(Engine(target), p, 24).token_ids for p in prompts]
    with torch.inference_mode():
        hf = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert expected[0] == hf
    draft = tiny_draft(target, block_size=8)
    oracle = OracleDraft(draft, expected[0], len(PROMPT), 0.6, seed=3)
    assert _greedy(Engine(target, oracle), PROMPT, 24, block=8, tree=16).token_ids == expected[0]
    batch = Engine(target, draft).batch()
    cfg = GenerationConfig(max_new_tokens=24, block_size=4, stop_token_ids=(), lookup=True)
    tokens = {}
    for p in prompts:
        seq, first = batch.join(p, cfg, GenerationStats())
        tokens[id(seq)] = (seq, list(first.tokens))
    while batch.sequences:
        for seq, st in batch.step():
            tokens[id(seq)][1].extend(st.tokens)
    assert [t for _, t in tokens.values()] == expected


def test_an_unknown_attention_implementation_verifies_chains_one_sequence_at_a_time():
    AttentionInterface.register("someone_elses_attention", sdpa_attention_forward)  # as it might apply a mask
    AttentionMaskInterface.register("someone_elses_attention", sdpa_mask)
    target = _llama("someone_elses_attention")
    assert not target.supports_trees
    engine = Engine(target, tiny_draft(target, block_size=4))
    assert engine.batch().capacity == 1
    with pytest.raises(BlockdraftError, match="tree verification"):
        _greedy(engine, PROMPT, 8, block=4, tree=8)
    assert _greedy(engine, PROMPT, 16, block=4).token_ids == _greedy(Engine(target), PROMPT, 16).token_ids


def test_unseeded_sampling_leaves_the_global_generator_alone():
    target = tiny_family("llama")
    engine = Engine(target, tiny_draft(target, block_size=4))
    cfg = GenerationConfig(max_new_tokens=8, block_size=4, stop_token_ids=(), lookup=False,
                           sampling=SamplingParams(temperature=0.9))
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    engine.generate(PROMPT, cfg)
    assert torch.equal(torch.rand(3), expected)


def test_a_seeded_request_gets_the_same_text_alone_and_in_a_busy_batch():
    target = tiny_family("qwen3")
    engine = Engine(target, tiny_draft(target, block_size=4))

    def config(temperature, seed, top_p=1.0):
        return GenerationConfig(max_new_tokens=24, block_size=4, stop_token_ids=(), lookup=True,
                                sampling=SamplingParams(temperature, 0, top_p, seed))

    mine = config(0.8, 7, 0.9)
    alone = engine.generate(PROMPT, mine).token_ids
    others = [([5, 17, 33, 2] * 3, config(1.0, None)), (list(range(40, 60)), config(0.0, None)),
              ([9, 9, 8, 7], config(0.5, 3))]
    batch = engine.batch()
    tokens = {}
    for i, (p, cfg) in enumerate(others[:2] + [(PROMPT, mine)] + others[2:]):
        seq, first = batch.join(p, cfg, GenerationStats())
        tokens[i] = (seq, list(first.tokens))
    while batch.sequences:
        for seq, st in batch.step():
            next(t for s, t in tokens.values() if s is seq).extend(st.tokens)
    assert tokens[2][1] == alone


def test_a_vanishing_temperature_decodes_greedily_instead_of_dividing_into_nan():
    target = tiny_family("llama")
    engine = Engine(target, tiny_draft(target, block_size=4))
    greedy = _greedy(Engine(target), PROMPT, 12).token_ids
    for t in (1e-40, 1e-6):
        cfg = GenerationConfig(max_new_tokens=12, block_size=4, stop_token_ids=(), lookup=False,
                               sampling=SamplingParams(temperature=t))
        assert engine.generate(PROMPT, cfg).token_ids == greedy
