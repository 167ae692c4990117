"""A drafter's shape: its config (what config.json holds, checkpoint.py reads and writes it), a
config sized like a target, and the checks a config must pass on its own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SCALED_ROPE_TYPES = ("linear", "yarn", "llama3")  # static in the position; dynamic / longrope are not


EMBEDDING_TAP = -1  # a "tap" of the target's embedding output: the context without the target's states
CONDITIONINGS = ("kv", "input")  # how the context enters the drafter (see DraftConfig.conditioning)


def default_target_layer_ids(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """K taps spread evenly from layer 1 to layer L-3 (DFLASH.md; Python's round). 0 taps: no
    target context, only the target's embedding of the context tokens (an ablation)."""
    if num_taps == 0:
        return [EMBEDDING_TAP]
    if num_taps == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 3) - 1
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    rope_scaling: dict | None = None  # the RoPE parameters of a scaled type (yarn, llama3, linear); None: default
    # per layer "full_attention" (the DFlash default: the block sees all context and itself) or
    # "sliding_attention" (z-lab's later drafters: the last `sliding_window` positions, causal);
    # None: all full. `is_causal` overrides causality for every layer, as the reference reads it.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    # "kv": DFlash's KV injection, the context features projected into every layer's keys and
    # values. "input": an ablation (EAGLE-3's way): the context features are input rows that pass
    # through the draft layers causally beside the block, and the block attends to their hidden states.
    conditioning: str = "kv"
    extra: dict = field(default_factory=dict)  # unknown config.json keys, kept on save

    @property
    def standard(self) -> bool:
        """A DFlash drafter as the reference, vLLM and SGLang run it (not an ablation variant)."""
        return self.conditioning == "kv" and EMBEDDING_TAP not in self.target_layer_ids

    def layer_attention(self, i: int) -> tuple[bool, int | None]:
        """(causal, window) of draft layer i."""
        sliding = self.layer_types is not None and self.layer_types[i] == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, self.sliding_window if sliding else None

    @property
    def plain_attention(self) -> bool:
        """Every layer full and bidirectional (what the trainer builds and its packed mask assumes)."""
        return all(self.layer_attention(i) == (False, None) for i in range(self.num_layers))


def build_draft_config(
    target_config,
    num_layers: int = 5,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int = 0,
    num_taps: int = 5,
    vocab_size: int | None = None,
    conditioning: str = "kv",
) -> DraftConfig:
    """A draft sized like the target (hidden size, heads, MLP width, RoPE base)."""
    t = target_config
    n_target = int(t.num_hidden_layers)
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    num_kv_heads = int(getattr(t, "num_key_value_heads", None) or t.num_attention_heads)
    if getattr(t, "kv_lora_rank", None):
        # MLA (DeepSeek-V3, Kimi-K2.5): no per-head K/V to copy; the draft's plain attention takes
        # the value head size and the target's query heads, with grouped K/V as in GQA targets
        head_dim = int(t.v_head_dim)
        num_kv_heads = max(k for k in (1, 2, 4, 8) if t.num_attention_heads % k == 0)
    rope = getattr(t, "rope_parameters", None) or {}
    if "full_attention" in rope:  # per layer type (Gemma-3): the draft's layers are full attention
        rope = rope["full_attention"] or {}
    theta = rope.get("rope_theta", None) or getattr(t, "rope_theta", None) or 10000.0
    # a scaled RoPE (LLaMA-3.1's llama3, DeepSeek-V3 / Kimi-K2.5's YaRN) is the draft's too, as in
    # z-lab's Kimi-K2.5 drafter
    kind = rope.get("rope_type", "default")
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if kind in SCALED_ROPE_TYPES else None
    return DraftConfig(
        hidden_size=int(t.hidden_size),
        intermediate_size=int(t.intermediate_size),
        num_layers=num_layers,
        num_heads=int(t.num_attention_heads),
        num_kv_heads=num_kv_heads,
        head_dim=int(head_dim),
        vocab_size=int(vocab_size or t.vocab_size),
        num_target_layers=n_target,
        target_layer_ids=list(target_layer_ids or default_target_layer_ids(n_target, num_taps)),
        mask_token_id=int(mask_token_id),
        block_size=block_size,
        rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(getattr(t, "max_position_embeddings", 32768)),
        rope_scaling=scaling,
        conditioning=conditioning,
    )


def init_scale_check(cfg: DraftConfig) -> None:
    """Sanity of a config on its own (fit to a target is checked in `checkpoint.check_fits`)."""
    from ..errors import BlockdraftError

    if cfg.block_size < 2:
        raise BlockdraftError(f"block_size must be >= 2 (got {cfg.block_size})")
    if cfg.num_layers < 1:
        raise BlockdraftError(f"num_layers must be >= 1 (got {cfg.num_layers})")
    if cfg.num_heads % cfg.num_kv_heads:
        raise BlockdraftError(
            f"num_attention_heads {cfg.num_heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}"
        )
    if cfg.conditioning not in CONDITIONINGS:
        raise BlockdraftError(f"conditioning must be one of {CONDITIONINGS} (got {cfg.conditioning!r})")
    if cfg.conditioning != "kv" and not cfg.plain_attention:
        raise BlockdraftError("input-fusion drafters have full bidirectional layers only")
    if cfg.head_dim % 2 or not math.isfinite(cfg.rope_theta) or cfg.rope_theta <= 0:
        raise BlockdraftError(f"bad head_dim {cfg.head_dim} or rope_theta {cfg.rope_theta}")
