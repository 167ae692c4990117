"""The DFlash draft model: a few Qwen3-style layers that denoise a whole block in one forward.

Conditioning ("KV injection"): the target's tapped hidden states are fused into context
features c = hidden_norm(fc(concat taps)), and every draft layer attends over
[k_proj(c) | k_proj(block)] and [v_proj(c) | v_proj(block)], with no causal mask.
The draft owns no embedding and no LM head: it reads the target's (shared, frozen).

Inference keeps the context K/V of committed positions in a `DraftCache`; the block's own
K/V are transient. Training calls the same layers with all blocks packed and a boolean mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import few_rows
from ..ops.norms import runs_fused
from .vocab import Ranked, SubsetHead, ranked, top_ids
from .draft_cache import DraftCache  # noqa: F401  (re-exported: the drafter's cache, beside the drafter)
from .draft_config import (  # noqa: F401  (re-exported: the drafter's config, beside the drafter)
    SCALED_ROPE_TYPES, DraftConfig, build_draft_config, default_target_layer_ids, init_scale_check,
)


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


def default_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """The default RoPE's inverse frequencies [D/2]."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype, scaling=None) -> tuple:
    """cos/sin tables for absolute positions [T] -> [T, D], or per sequence [B, T] -> [B, 1, T, D]
    (the default RoPE of Llama/Qwen; `scaling`: (inv_freq, factor) of a scaled one)."""
    if scaling is None:
        inv_freq, factor = default_inv_freq(head_dim, theta, positions.device), 1.0
    else:
        inv_freq, factor = scaling[0].to(positions.device), scaling[1]
    freqs = positions.float()[..., None] * inv_freq  # [..., T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., T, D]
    if emb.dim() == 3:
        emb = emb[:, None]  # [B, 1, T, D]: broadcast over heads
    if factor == 1.0:  # (a decode step's few rows: every op here is mostly its dispatch)
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos_sin: tuple) -> torch.Tensor:
    """x: [B, heads, T, D]."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def norm_rope(norm: nn.Module, x: torch.Tensor, cos_sin: tuple) -> torch.Tensor:
    """Per-head `norm` then RoPE: x [B, T, heads, D] -> [B, heads, T, D]; one fused pass where `norm`
    runs fused (ops/norms.py), else as written."""
    if not runs_fused(norm, x):
        return apply_rope(norm(x).transpose(1, 2), cos_sin)
    cos, sin = cos_sin  # [T, D] or [B, 1, T, D]
    cos, sin = (cos[None], sin[None]) if cos.dim() == 2 else (cos[:, 0], sin[:, 0])  # [1 or B, T, D]
    return few_rows.norm_rope(x, norm.weight.detach(), norm.eps, cos, sin)


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
        k = norm_rope(self.k_norm, self.k_proj(x).view(b, t, self.cfg.num_kv_heads, self.cfg.head_dim), cos_sin)
        v = self.v_proj(x).view(b, t, self.cfg.num_kv_heads, self.cfg.head_dim).transpose(1, 2)
        return k, v  # [B, Hkv, T, D] each

    def context_kv(self, c: torch.Tensor, cos_sin: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of context features c [B, Tc, H] (injected into this layer)."""
        return self._kv(c, cos_sin)

    def forward(self, x, cos_sin, ctx_k, ctx_v, mask=None) -> torch.Tensor:
        """ctx_k/ctx_v: [B, Hkv, Tc, D], or a list of B such [1, Hkv, Tc_r, D] (a batch of
        sequences, each with a context of its own: its own attention, the projections shared)."""
        b, t, _ = x.shape
        q = norm_rope(self.q_norm, self.q_proj(x).view(b, t, -1, self.cfg.head_dim), cos_sin)  # [B, Hq, T, D]
        k, v = self._kv(x, cos_sin)
        if isinstance(ctx_k, list):
            out = torch.cat([self._attend(q[r:r + 1], torch.cat([ctx_k[r], k[r:r + 1]], dim=2),
                                          torch.cat([ctx_v[r], v[r:r + 1]], dim=2), None) for r in range(b)])
        else:
            out = self._attend(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask)
        return self.o_proj(out.reshape(b, t, -1))

    def decode(self, x, c, cos_sin, cache: DraftCache, layer: int) -> torch.Tensor:
        """A decode step of one sequence: the block's rows x [1, Tb, H] and the new context features
        c [1, Tc, H] through the K/V projections together (one call each, not one for the context
        and one for the block). The context's K/V join `cache`, the block's follow them in its
        buffer (scratch past its length), and the block's queries attend over all of them.
        cos_sin: [Tc + Tb, D], the context's positions then the block's."""
        b, tb, _ = x.shape
        tc = c.shape[1]
        cos, sin = cos_sin
        q = norm_rope(self.q_norm, self.q_proj(x).view(b, tb, -1, self.cfg.head_dim), (cos[tc:], sin[tc:]))  # [1, Hq, Tb, D]
        k, v = self._kv(torch.cat([c, x], dim=1), cos_sin)  # [1, Hkv, Tc + Tb, D] each
        k, v = cache.append(layer, k, v)  # [1, Hkv, cached + Tc + Tb, D]: the block's rows last
        return self.o_proj(self._attend(q, k, v, None).reshape(b, tb, -1))

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        """[B, T, Hq, D]: the block's queries [B, Hq, T, D] against the keys and values
        [B, Hkv, S, D] of the context and the block (the block's last)."""
        if mask is None:  # inference: context then block, in position order
            mask = window_mask(q.shape[2], k.shape[2], self.causal, self.window, q.device)
        if runs_fused(self.q_norm, q) and few_rows.attention_fits(q, k, v):  # the engine's drafter: the few-row attention too
            if mask is not None:
                mask = mask.expand(q.shape[0], 1, *mask.shape[-2:])  # [B, 1, T, S]
            return few_rows.attention(q, k, v, mask)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.cfg.num_heads != self.cfg.num_kv_heads
        ).transpose(1, 2)  # [B, T, Hq, D]


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
        return self._residuals(x, lambda h: self.self_attn(h, cos_sin, ctx_k, ctx_v, mask))

    def decode(self, x, c, cos_sin, cache: DraftCache, index: int):
        """A decode step over a draft cache (`DraftAttention.decode`)."""
        return self._residuals(x, lambda h: self.self_attn.decode(h, c, cos_sin, cache, index))

    def _residuals(self, x, attend):
        x = x + attend(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self._subset_head = None  # ((the target head's weight, dtype, subset, storage), its SubsetHead), made on first use
        self.weight_storage: torch.dtype | None = None  # bf16: the packed linear layers' weights (Engine, precision.draft_precision)
        self._rope_scaling = None  # (inv_freq, factor) of its RoPE, made on first use

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

    @property
    def precision(self) -> str:
        """What the drafter computes in, and its packed weights' storage where that differs."""
        return str(self.dtype) if self.weight_storage is None else f"{self.weight_storage} weights, {self.dtype} compute"

    def head_for(self, lm_head: nn.Module) -> nn.Module:
        """The head the draft scores with: the target's `lm_head` itself, or a copy of its rows
        of the draft vocabulary subset and/or in the draft's dtype or weight storage (a
        `SubsetHead`, made once per target head, dtype and storage)."""
        # a head over GGUF blocks (gguf_target.BlockLinear) makes its fp32 weight on each access:
        # its blocks, which do not change, say whether the copy made before still holds
        blocks = None if isinstance(lm_head, nn.Linear) else getattr(lm_head, "panels", None)  # (PackedLinear's are its own)
        dtype = torch.float32 if blocks is not None else lm_head.weight.dtype
        if self.vocab_ids is None and dtype == self.dtype and self.weight_storage is None:
            return lm_head
        key = (blocks if blocks is not None else lm_head.weight, self.dtype, self.vocab_ids, self.weight_storage)
        if self._subset_head is None or any(a is not b for a, b in zip(self._subset_head[0], key)):
            from ..ops.packed import prepack

            weight = lm_head.weight
            ids = self.vocab_ids if self.vocab_ids is not None else torch.arange(weight.shape[0])
            head = SubsetHead(weight.detach().to(self.dtype), ids)
            head = prepack(head, self.weight_storage)
            self._subset_head = (key, head)
        return self._subset_head[1]

    def rope(self, positions: torch.Tensor, dtype) -> tuple:
        if self._rope_scaling is None or self._rope_scaling[0].device != positions.device:  # made once, not per call
            self._rope_scaling = scaled_rope(self.cfg, positions.device) if self.cfg.rope_scaling is not None \
                else (default_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, positions.device), 1.0)
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
        if self.cfg.conditioning == "input":
            return self._input_fusion(x, block_positions, c, context_positions, cache, mask)
        if cache is not None and mask is None and block_positions.dim() == 1:  # a decode step
            rope = self.rope(torch.cat([context_positions, block_positions]), x.dtype)  # [Tc + Tb, D]
            for i, layer in enumerate(self.layers):
                x = layer.decode(x, c, rope, cache, i)
            cache.length += c.shape[1]
            return self.norm(x)
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

    def _input_fusion(self, x, block_positions, c, context_positions, cache, mask) -> torch.Tensor:
        """The "input" conditioning (an ablation, EAGLE-3's way): the new context features c
        [B, Tc, H] are rows of the layers' input beside the block x [B, Tb, H]; context rows attend
        causally to the context, block rows to the context and their own block, at every layer
        through the context rows' hidden states there. Each layer's context K/V go to `cache` as
        KV injection's do. `mask` [B, 1, Tb, Tcache + Tc + Tb] says what block rows see (None: all)."""
        b, tc, tb = x.shape[0], c.shape[1], x.shape[1]
        past = cache.length if cache is not None else 0
        ctx_pos = context_positions if block_positions.dim() == 1 else context_positions.expand(b, -1)
        ctx_rope = self.rope(context_positions, x.dtype)
        both_rope = self.rope(torch.cat([ctx_pos, block_positions], dim=-1), x.dtype)
        # keys: [cached + new context (from the cache) | the layer's own K of the new context rows,
        # never seen: they duplicate the cached ones | the block]
        dev = x.device
        ctx_rows = torch.cat([torch.ones(tc, past, dtype=torch.bool, device=dev),
                              torch.ones(tc, tc, dtype=torch.bool, device=dev).tril(),
                              torch.zeros(tc, tc + tb, dtype=torch.bool, device=dev)], dim=1)  # [Tc, P+2Tc+Tb]
        if mask is None:
            mask = torch.ones(1, 1, tb, past + tc + tb, dtype=torch.bool, device=dev)
        hidden_dup = torch.zeros(*mask.shape[:3], tc, dtype=torch.bool, device=dev)
        block_rows = torch.cat([mask[..., : past + tc], hidden_dup, mask[..., past + tc :]], dim=-1)
        full = torch.cat([ctx_rows.expand(block_rows.shape[0], 1, -1, -1), block_rows], dim=2)  # [B, 1, Tc+Tb, P+2Tc+Tb]
        h = torch.cat([c, x], dim=1)  # [B, Tc + Tb, H]
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = layer.self_attn.context_kv(layer.input_layernorm(h[:, :tc]), ctx_rope)
            if cache is not None:
                ctx_k, ctx_v = cache.append(i, ctx_k, ctx_v)
            h = layer(h, both_rope, ctx_k, ctx_v, full)
        if cache is not None:
            cache.length += tc
        return self.norm(h[:, tc:])

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

    def blocks_hidden(
        self, embed: nn.Module, caches: list[DraftCache], context_taps: list[torch.Tensor], anchors: list[int],
        positions: list[int], block: int,
    ) -> torch.Tensor:
        """`block_hidden` of several sequences in one forward, each with its own cache and pending
        taps [1, Tc_r, K*H]: the linear layers run once over every sequence's rows (their weights
        read once, not once per sequence), the attention per sequence. Returns [B, block-1, H]."""
        if self.cfg.conditioning != "kv":  # an ablation variant: one sequence at a time
            return torch.stack([self.block_hidden(embed, cache, taps, a, p, block)
                                for cache, taps, a, p in zip(caches, context_taps, anchors, positions)])
        device = context_taps[0].device
        ids = torch.full((len(caches), block), self.cfg.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = torch.tensor(anchors, device=device)
        block_positions = torch.tensor(positions, device=device)[:, None] + torch.arange(block, device=device)
        sizes = [t.shape[1] for t in context_taps]
        ctx_positions = torch.cat([torch.arange(c.length, c.length + n, device=device) for c, n in zip(caches, sizes)])
        x = embed(ids).to(self.dtype)  # [B, block, H]
        c = self.fuse(torch.cat(context_taps, dim=1).to(self.dtype))  # [1, sum Tc_r, H]: every new context
        block_rope, ctx_rope = self.rope(block_positions, x.dtype), self.rope(ctx_positions, x.dtype)
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = layer.self_attn.context_kv(c, ctx_rope)  # [1, Hkv, sum Tc_r, D]
            kv = [cache.append(i, k, v) for cache, k, v in zip(caches, ctx_k.split(sizes, 2), ctx_v.split(sizes, 2))]
            x = layer(x, block_rope, [k for k, _ in kv], [v for _, v in kv])
        for cache, n in zip(caches, sizes):
            cache.length += n
        return self.norm(x)[:, 1:]

    def block_logits(
        self, embed: nn.Module, lm_head: nn.Module, cache: DraftCache, context_taps: torch.Tensor,
        anchor: int, position: int, block: int,
    ) -> torch.Tensor:
        """The draft logits [block-1, V] of one block (see `block_hidden`)."""
        return lm_head(self.block_hidden(embed, cache, context_taps, anchor, position, block))

    def block_top(
        self, embed: nn.Module, lm_head: nn.Module, cache: DraftCache, context_taps: torch.Tensor,
        anchor: int, position: int, block: int, k: int,
    ) -> torch.Tensor:
        """The ids of the `k` best tokens of each block position [block-1, k], best first (k = 1: the
        greedy proposals; a tree's candidates): `vocab.top_ids(block_logits(...), k)`, with a subset
        head's taken on the subset (no full-vocabulary logits to build and scan)."""
        return _best_ids(lm_head, self.block_hidden(embed, cache, context_taps, anchor, position, block), k)

    def block_ranked(
        self, embed: nn.Module, lm_head: nn.Module, cache: DraftCache, context_taps: torch.Tensor,
        anchor: int, position: int, block: int, k: int,
    ) -> Ranked:
        """`block_top`'s ids [block-1, k] with the drafter's probability of each (a tree's candidates
        and its confidence in them, tree.py)."""
        return _ranked(lm_head, self.block_hidden(embed, cache, context_taps, anchor, position, block), k)

    @torch.inference_mode()
    def matching_prefix(
        self, embed: nn.Module, lm_head: nn.Module, cache: DraftCache, context_taps: torch.Tensor,
        anchor: int, position: int, block: int, truth: list[int],
    ) -> int:
        """How many of the block's greedy proposals equal `truth` in a row (tau by replay). The LM
        head runs row by row, only as far as they match: most blocks end at the first row."""
        hidden = self.block_hidden(embed, cache, context_taps, anchor, position, block)
        n = 0
        while n < min(len(truth), block - 1) and int(_best_ids(lm_head, hidden[n:n + 1], 1)) == truth[n]:
            n += 1
        return n

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _best_ids(lm_head: nn.Module, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the `k` best tokens of each row of `hidden` [..., k]: on a subset head's own rows
    (`SubsetHead.top`), else from the head's logits."""
    return lm_head.top(hidden, k) if hasattr(lm_head, "top") else top_ids(lm_head(hidden), k)


def _ranked(lm_head: nn.Module, hidden: torch.Tensor, k: int) -> Ranked:
    """`_best_ids` with the probabilities of those tokens (`vocab.Ranked`)."""
    return lm_head.ranked(hidden, k) if hasattr(lm_head, "ranked") else ranked(lm_head(hidden), k)
