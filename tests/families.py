"""Tiny random models of every family DFlash drafters are published for (transformers' own
classes, never forked), plus a few the engine must refuse. Each is 4 layers, hidden 64."""

import torch
import transformers as tf

from blockdraft.models.target import Target

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
WINDOW = 8  # sliding windows shorter than the prompts and blocks of the tests: the window slides inside a block


def _config(family: str):
    c = dict(COMMON)
    if family == "llama":
        return tf.LlamaConfig(**c)
    if family == "llama3-rope":  # LLaMA-3.1's RoPE scaling
        return tf.LlamaConfig(**c, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                              low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64))
    if family == "qwen3":
        return tf.Qwen3Config(**c, head_dim=16)
    if family == "qwen3-moe":
        return tf.Qwen3MoeConfig(**c, head_dim=16, **MOE)
    if family == "qwen3.5":  # Gated DeltaNet linear attention, 3 of 4 layers
        return tf.Qwen3_5TextConfig(**c, head_dim=16, **LINEAR)
    if family == "qwen3.5-moe":
        return tf.Qwen3_5MoeTextConfig(**c, head_dim=16, **LINEAR, **MOE, shared_expert_intermediate_size=32)
    if family == "qwen3-next":
        return tf.Qwen3NextConfig(**c, head_dim=16, **LINEAR, **MOE, shared_expert_intermediate_size=32)
    if family == "lfm2":  # short convolutions
        return tf.Lfm2Config(**c, layer_types=["conv", "conv", "full_attention", "conv"])
    if family == "gpt-oss":  # alternating sliding/full attention, attention sinks, MoE
        return tf.GptOssConfig(**c, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)
    if family == "mistral-sliding":
        return tf.MistralConfig(**c, sliding_window=WINDOW)
    if family == "gemma3":  # sliding/full layers with their own RoPE, soft-capped logits
        return tf.Gemma3TextConfig(**c, head_dim=16, sliding_window=WINDOW, final_logit_softcapping=30.0)
    if family == "deepseek-v3":  # MLA attention, MoE (the Kimi-K2.5 family)
        c["num_key_value_heads"] = 4
        return tf.DeepseekV3Config(**c, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                   qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1)
    if family == "deepseek-v2":  # MLA attention (V's head dim differs from K's), MoE
        c["num_key_value_heads"] = 4
        return tf.DeepseekV2Config(**c, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                   qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1)
    if family == "minicpm3":  # MLA attention, dense
        c["num_key_value_heads"] = 4
        return tf.MiniCPM3Config(**c, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                 v_head_dim=16)
    if family == "glm4-moe":
        return tf.Glm4MoeConfig(**c, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                first_k_dense_replace=1, n_group=1, topk_group=1)
    if family == "glm4-moe-lite":  # GLM-4.7-Flash: MLA attention, MoE
        c["num_key_value_heads"] = 4
        return tf.Glm4MoeLiteConfig(**c, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                    qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1)
    if family == "gemma4":
        return tf.Gemma4TextConfig(**c, head_dim=16, global_head_dim=16, sliding_window=WINDOW,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"])
    if family == "minimax-m2":
        return tf.MiniMaxM2Config(**c, head_dim=16, num_local_experts=2, num_experts_per_tok=1)
    if family == "deepseek-v3.2":  # refused by the probe: sparse attention whose selection a block changes
        c["num_key_value_heads"] = 4
        return tf.DeepseekV32Config(**c, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                    qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, index_topk=4,
                                    index_n_heads=2, index_head_dim=16)
    if family == "phi3":
        return tf.Phi3Config(**c)
    if family == "olmo2":
        return tf.Olmo2Config(**c)
    if family == "falcon-h1":  # Mamba-2 and attention side by side in every layer
        return tf.FalconH1Config(**c, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                                 mamba_chunk_size=16)
    if family == "granite-hybrid":
        return tf.GraniteMoeHybridConfig(**c, num_local_experts=2, num_experts_per_tok=1, mamba_d_state=8,
                                         mamba_n_heads=4, mamba_d_head=32, mamba_chunk_size=16,
                                         layer_types=["mamba", "attention", "mamba", "attention"])
    if family == "nemotron-h":
        c.pop("num_hidden_layers")
        return tf.NemotronHConfig(**c, hybrid_override_pattern="M*M-", mamba_num_heads=4, mamba_head_dim=16,
                                  ssm_state_size=8, n_groups=1, chunk_size=16)
    if family == "jamba":  # refused by the probe: its multi-token Mamba scan drops the cached state
        return tf.JambaConfig(**c, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                              expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, use_mamba_kernels=False)
    if family == "minimax":  # refused by the probe: it insists on a cache class of its own
        return tf.MiniMaxConfig(**c, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                                layer_types=["linear_attention", "full_attention"] * 2)
    if family == "recurrent-gemma":  # refused by the probe: its recurrent blocks keep their own state
        return tf.RecurrentGemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=1, lru_width=64,
                                       attention_window_size=8)
    if family == "mamba":  # all-recurrent: refused
        return tf.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    raise KeyError(family)


# Families the engine runs exactly (tests/test_families.py), and which of them keep a recurrent
# state or slide a window (the ones the sampled-distribution test also covers).
SUPPORTED = ["llama", "llama3-rope", "qwen3", "qwen3-moe", "qwen3.5", "qwen3.5-moe", "qwen3-next", "lfm2",
             "gpt-oss", "mistral-sliding", "gemma3", "deepseek-v3", "glm4-moe", "phi3", "olmo2", "falcon-h1",
             "granite-hybrid", "nemotron-h", "glm4-moe-lite", "gemma4", "minimax-m2", "deepseek-v2", "minicpm3"]
STATEFUL = ["qwen3.5", "qwen3.5-moe", "qwen3-next", "lfm2", "falcon-h1", "granite-hybrid", "nemotron-h"]
SLIDING = ["gpt-oss", "mistral-sliding", "gemma3", "gemma4"]
REFUSED = ["mamba"]  # refused when wrapped (no past_key_values)
REFUSED_BY_PROBE = {"jamba": "differ from plain decoding", "minimax": "fails on it", "recurrent-gemma": "fails on it",
                    "deepseek-v3.2": "differ from plain decoding"}


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(_config(family)).float().eval()


def tiny_family(family: str, seed: int = 0) -> Target:
    return Target(tiny_model(family, seed), tokenizer=None, name=f"tiny-{family}")
