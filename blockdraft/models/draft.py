"""The DFlash draft model: a few Qwen3-style layers that denoise a whole block in one forward.

Conditioning ("KV injection"): the target's tapped hidden states are fused into context
features c = hidden_norm(fc(concat taps)), and every draft layer attends over
[k_proj(c) | k_proj(block)] and [v_proj(c) | v_proj(block)], with no causal mask.
The draft owns no embedding and no LM head: it reads the target's (shared, frozen).

Inference keeps the context K/V of committed positions in a `DraftCache`; the block's own
K/V are transient. Training calls the same layers with all blocks packed and a boolean mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


def default_target_layer_ids(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """K taps spread evenly from layer 1 to layer L-3 (DFLASH.md; Python's round)."""
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
    extra: dict = field(default_factory=dict)  # unknown config.json keys, kept on save

    def layer_attention(self, i: int) -> tuple[bool, int | None]:
        """(causal, window) of draft layer i."""
        sliding = self.layer_types is not None and self.layer_types[i] == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, self.sliding_window if sliding else None

    @property
    def plain_attention(self) -> bool:
        """Every layer full and bidirectional (what the trainer builds and its packed mask assumes)."""
        return all(self.layer_attention(i) == (False, None) for i in range(self.num_layers))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as Qwen3 does), scale in the input dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


SCALED_ROPE_TYPES = ("linear", "yarn", "llama3")  # static in the position; dynamic / longrope are not


def scaled_rope(cfg: "DraftConfig", device) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] and the cos/sin factor of a scaled RoPE (e.g. the YaRN of z-lab's
    Kimi-K2.5 drafter), computed by transformers' own RoPE functions, as the reference's
    `Qwen3RotaryEmbedding` computes them."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = Qwen3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, head_dim=cfg.head_dim,
                     num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
                     rope_parameters={**cfg.rope_scaling, "rope_theta": cfg.rope_theta})
    inv_freq, factor = ROPE_INIT_FUNCTIONS[cfg.rope_scaling["rope_type"]](hf, device)
    return inv_freq.float(), float(factor)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype, scaling=None) -> tuple:
    """cos/sin tables for absolute positions [T] -> [T, D], or per sequence [B, T] -> [B, 1, T, D]
    (the default RoPE of Llama/Qwen; `scaling`: (inv_freq, factor) of a scaled one)."""
    if scaling is None:
        inv_freq, factor = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)), 1.0
    else:
        inv_freq, factor = scaling[0].to(positions.device), scaling[1]
    freqs = positions.float()[..., None] * inv_freq  # [..., T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., T, D]
    if emb.dim() == 3:
        emb = emb[:, None]  # [B, 1, T, D]: broadcast over heads
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos_sin: tuple) -> torch.Tensor:
    """x: [B, heads, T, D]."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def window_mask(queries: int, keys: int, causal: bool, window: int | None, device) -> torch.Tensor | None:
    """[queries, keys] bool (True = may attend) for a block whose queries are the last `queries`
    of `keys` positions in order, as the reference builds it; None when everything is visible."""
    if not causal and window is None:
        return None
    q = torch.arange(keys - queries, keys, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    visible = torch.ones(queries, keys, dtype=torch.bool, device=device)
    if causal:
        visible &= k <= q
    if window is not None:
        visible &= (q - k < window) & (causal | (k - q < window))
    return visible


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.causal, self.window = cfg.layer_attention(layer)
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos_sin: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.cfg.num_kv_heads, self.cfg.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.cfg.num_kv_heads, self.cfg.head_dim).transpose(1, 2)
        return apply_rope(k, cos_sin), v  # [B, Hkv, T, D] each

    def context_kv(self, c: torch.Tensor, cos_sin: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of context features c [B, Tc, H] (injected into this layer)."""
        return self._kv(c, cos_sin)

    def forward(self, x, cos_sin, ctx_k, ctx_v, mask=None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.cfg.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos_sin)  # [B, Hq, T, D]
        k, v = self._kv(x, cos_sin)
        k = torch.cat([ctx_k, k], dim=2)  # [B, Hkv, Tc + T, D]
        v = torch.cat([ctx_v, v], dim=2)
        if mask is None:  # inference: context then block, in position order
            mask = window_mask(t, k.shape[2], self.causal, self.window, x.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.cfg.num_heads != self.cfg.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, x, cos_sin, ctx_k, ctx_v, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftCache:
    """Per-layer K/V of committed context positions only, in buffers that grow by doubling."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new context K/V [B, Hkv, n, D] after the committed ones; return the full view."""
        start, n = self.length, k.shape[2]
        buf = self.k[layer]
        if buf is None or buf.shape[2] < start + n:
            cap = max(64, 2 * (start + n))
            new_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            new_v = v.new_empty(new_k.shape)
            if buf is not None:
                new_k[:, :, :start] = buf[:, :, :start]
                new_v[:, :, :start] = self.v[layer][:, :, :start]
            self.k[layer], self.v[layer] = new_k, new_v
        self.k[layer][:, :, start : start + n] = k
        self.v[layer][:, :, start : start + n] = v
        return self.k[layer][:, :, : start + n], self.v[layer][:, :, : start + n]


class DraftModel(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        k = len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.apply(self._init_weights)
        # the draft vocabulary subset (vocab.py), sorted target ids; None: the full vocabulary
        self.vocab_ids: torch.Tensor | None = None
        self._subset_head = None  # ((the target head's weight, dtype, subset), its SubsetHead), made on first use
        self._rope_scaling = None  # (inv_freq, factor) of a scaled RoPE, made on first use

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def head_for(self, lm_head: nn.Module) -> nn.Module:
        """The head the draft scores with: the target's `lm_head` itself, or a copy of its rows
        of the draft vocabulary subset and/or in the draft's dtype (a `SubsetHead`, made once
        per target head and dtype)."""
        weight = lm_head.weight
        if self.vocab_ids is None and weight.dtype == self.dtype:
            return lm_head
        key = (weight, self.dtype, self.vocab_ids)
        if self._subset_head is None or any(a is not b for a, b in zip(self._subset_head[0], key)):
            from .kernels import prepack
            from .vocab import SubsetHead

            ids = self.vocab_ids if self.vocab_ids is not None else torch.arange(weight.shape[0])
            head = SubsetHead(weight.detach().to(self.dtype), ids)
            prepack(head)
            self._subset_head = (key, head)
        return self._subset_head[1]

    def rope(self, positions: torch.Tensor, dtype) -> tuple:
        if self.cfg.rope_scaling is not None and self._rope_scaling is None:
            self._rope_scaling = scaled_rope(self.cfg, positions.device)
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype, self._rope_scaling)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Context features c [B, T, H] from concatenated target taps [B, T, K*H]."""
        return self.hidden_norm(self.fc(taps))

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, Tb, H]: target embedding of the block tokens
        block_positions: torch.Tensor,  # [Tb] or [B, Tb] absolute positions
        context_taps: torch.Tensor,  # [B, Tc, K*H]: new context (inference) or all of it (training)
        context_positions: torch.Tensor,  # [Tc]
        cache: DraftCache | None = None,
        mask: torch.Tensor | None = None,  # [B, 1, Tb, Tcache + Tc + Tb] bool, True = may attend
    ) -> torch.Tensor:
        """Final-normed hidden states of the block [B, Tb, H]; apply the target's LM head."""
        x = block_embeds
        c = self.fuse(context_taps)
        block_rope = self.rope(block_positions, x.dtype)
        ctx_rope = self.rope(context_positions, x.dtype)
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = layer.self_attn.context_kv(c, ctx_rope)
            if cache is not None:
                ctx_k, ctx_v = cache.append(i, ctx_k, ctx_v)
            x = layer(x, block_rope, ctx_k, ctx_v, mask)
        if cache is not None:
            cache.length += context_taps.shape[1]
        return self.norm(x)

    def block_hidden(
        self, embed: nn.Module, cache: DraftCache, context_taps: torch.Tensor, anchor: int, position: int, block: int,
    ) -> torch.Tensor:
        """One draft forward on [anchor, mask x (block-1)] at positions position..position+block-1,
        with the target's embedding. Absorbs the pending context taps [1, Tc, K*H] into the cache;
        returns the final hidden states [block-1, H] of positions 1..block-1 (apply the LM head)."""
        device = context_taps.device
        ids = torch.full((1, block), self.cfg.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = anchor
        hidden = self(
            embed(ids).to(self.dtype),  # the draft may run in another dtype than the target (bf16)
            torch.arange(position, position + block, device=device),
            context_taps.to(self.dtype),
            torch.arange(cache.length, cache.length + context_taps.shape[1], device=device),
            cache,
        )  # [1, block, H]
        return hidden[0, 1:]

    def block_logits(
        self, embed: nn.Module, lm_head: nn.Module, cache: DraftCache, context_taps: torch.Tensor,
        anchor: int, position: int, block: int,
    ) -> torch.Tensor:
        """The draft logits [block-1, V] of one block (see `block_hidden`)."""
        return lm_head(self.block_hidden(embed, cache, context_taps, anchor, position, block))

    @torch.inference_mode()
    def matching_prefix(
        self, embed: nn.Module, lm_head: nn.Module, cache: DraftCache, context_taps: torch.Tensor,
        anchor: int, position: int, block: int, truth: list[int],
    ) -> int:
        """How many of the block's greedy proposals equal `truth` in a row (tau by replay). The LM
        head runs row by row, only as far as they match: most blocks end at the first row."""
        hidden = self.block_hidden(embed, cache, context_taps, anchor, position, block)
        n = 0
        while n < min(len(truth), block - 1) and int(lm_head(hidden[n]).argmax()) == truth[n]:
            n += 1
        return n

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_draft_config(
    target_config,
    num_layers: int = 5,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int = 0,
    num_taps: int = 5,
    vocab_size: int | None = None,
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
    if cfg.head_dim % 2 or not math.isfinite(cfg.rope_theta) or cfg.rope_theta <= 0:
        raise BlockdraftError(f"bad head_dim {cfg.head_dim} or rope_theta {cfg.rope_theta}")
