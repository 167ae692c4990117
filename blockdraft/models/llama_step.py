"""A Llama decoder's forward over a decode step's few rows, without transformers' modules (issue 50).

Once the linear layers compute from GGUF blocks, SmolLM2's one-token forward was ~7.5 ms of
kernels inside ~19.5 ms: the rest was transformers' per-module Python (decorators, keyword
arguments, output recording hooks, the mask and cache machinery) and some sixteen small ops a layer
for the rotary embedding and the cache's copy. `LlamaStep.forward` runs the same kernels on the same
tensors, in transformers' order, from one loop: the fused norms (ops/norms.py), the projections as
modules (stacked GGUF blocks or prepacked fp32), the rotary embedding and cache append in one pass
(`few_rows.rope_append`, bitwise `apply_rotary_pos_emb`), the few-row attention kernel over the
cache's buffer (in place, `cache.kv_room`), the MLP. Every value is therefore bitwise what the
module path computes, which `matches_model` checks on a probe when a target is wrapped; a model
where it does not is left on the module path.

It runs where the module path would run the few-row kernels itself: a model whose decoder is
transformers' `LlamaModel` of `LlamaDecoderLayer`s (attention `LlamaAttention` or our
`BlockAttention`, MLP `LlamaMLP` or `BlockMLP`, fused norms, the `blockdraft_sdpa` attention),
fp32 on a CPU where the kernel runs, a cache of plain attention layers already holding a prefix,
and at most `few_rows.MAX_ROWS` rows. A prompt's prefill and everything else take the module path.
BLOCKDRAFT_LLAMA_STEP=0 turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..ops import few_rows
from .cache import crop, kv_room, plain_attention
from .gguf_target import DENSE_ROWS, BlockLinear
from ..ops.attention import SHARED_KV_ATTENTION
from ..ops.switch import packed_enabled
from ..ops.norms import is_fused

DECODERS = ("LlamaModel",)  # decoder classes whose forward `LlamaStep.forward` repeats
LAYERS = ("LlamaDecoderLayer",)
ATTENTIONS = ("LlamaAttention", "BlockAttention")
MLPS = ("LlamaMLP", "BlockMLP")
_NONE = torch.empty(0)  # the extension's "no mask": every row sees every key


def enabled() -> bool:
    return os.environ.get("BLOCKDRAFT_LLAMA_STEP", "1") != "0"


def _direct(proj: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A projection as the call its module makes on rows [M, K] -> [M, N]: a BlockLinear's kernel
    call itself (`rows_kernel`, without forward's checks, which `LlamaStep.runs` makes once a
    step); any other module as it is."""
    return proj.rows_kernel() if isinstance(proj, BlockLinear) else proj


@dataclass
class StepLayer:
    """One decoder layer's parts, as `LlamaStep.forward` calls them."""

    input_norm: nn.Module
    qkv: list[Callable]  # one stacked projection (BlockAttention's) or q_proj, k_proj, v_proj
    splits: list[int]  # the stacked projection's Q, K, V widths
    o_proj: Callable
    post_norm: nn.Module
    gate_up: list[Callable]  # one stacked projection (BlockMLP's) or gate_proj, up_proj
    split_mlp: list[int]  # the stacked projection's gate and up widths
    down: Callable
    act: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class StepOutput:
    hidden: torch.Tensor  # [B, keep, H] the last `keep` rows, final-normed
    # decoder layer i's output [B, T, H] for the layers asked for (-1: the embedding's); the last
    # layer's final-normed, as transformers records it in `hidden_states`
    layers: dict[int, torch.Tensor]


class LlamaStep:
    """transformers' LlamaModel.forward for a decode step's few rows (module docstring). It holds
    the model's modules as they are when built (the packed layers and fused norms ops/ swapped in):
    a model unpacked or unfused after needs a new step (`Target.step = LlamaStep.build(model)`)."""

    def __init__(self, model: nn.Module, layers: list[StepLayer]):
        base = model.base_model
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        self.layers = layers
        attn = base.layers[0].self_attn
        self.head_dim, self.scaling = int(attn.head_dim), float(attn.scaling)
        self.norms = [self.norm] + [n for l in layers for n in (l.input_norm, l.post_norm)]
        self.ext = few_rows.library()

    @classmethod
    def build(cls, model: nn.Module) -> LlamaStep | None:
        """The step for `model`, or None where its forward is not the one this class repeats."""
        base = getattr(model, "base_model", None)
        config = getattr(model, "config", None)
        if not enabled() or base is None or type(base).__name__ not in DECODERS \
                or getattr(config, "_attn_implementation", None) != SHARED_KV_ATTENTION:
            return None
        w = base.embed_tokens.weight
        if not few_rows.runs_on(w.device, w.dtype):
            return None
        layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(layer).__name__ not in LAYERS or type(attn).__name__ not in ATTENTIONS \
                    or type(mlp).__name__ not in MLPS:
                return None
            if hasattr(attn, "qkv"):
                qkv, splits = [_direct(attn.qkv)], list(attn.splits)
            else:
                qkv, splits = [attn.q_proj, attn.k_proj, attn.v_proj], []
            fused = hasattr(mlp, "gate_up")
            gate_up = [_direct(mlp.gate_up)] if fused else [mlp.gate_proj, mlp.up_proj]
            layers.append(StepLayer(layer.input_layernorm, qkv, splits, _direct(attn.o_proj),
                                    layer.post_attention_layernorm, gate_up, [mlp.width] * 2 if fused else [],
                                    _direct(mlp.down_proj),
                                    mlp.act_fn))
        step = cls(model, layers)
        return step if all(is_fused(n) for n in step.norms) else None

    def runs(self, kv, rows: int, mask: torch.Tensor | None, taps=()) -> bool:
        """Whether a forward of `rows` rows in all (every sequence's) against the cache `kv`
        (transformers' DynamicCache) takes this step: plain attention layers holding a prefix, a
        bool mask or none, fewer rows than a block layer takes its dense weight for, taps of
        decoder layers or -1 (the embedding's output, transformers' `hidden_states[0]`)."""
        if any(not -1 <= i < len(self.layers) for i in taps) or rows > few_rows.MAX_ROWS or rows >= DENSE_ROWS \
                or not packed_enabled() or torch.is_grad_enabled() \
                or (mask is not None and mask.dtype != torch.bool) or len(kv.layers) != len(self.layers):
            return False
        first = kv.layers[0]
        return all(plain_attention(l) and l.is_initialized for l in kv.layers) \
            and first.keys.dim() == 4 and first.keys.shape[2] > 0 and all(is_fused(n) for n in self.norms)

    def forward(self, ids: torch.Tensor, kv, positions: torch.Tensor, mask: torch.Tensor | None,
                taps=(), keep: int | None = None) -> StepOutput:
        """ids [B, T] at positions [B, T] after the S0 entries of `kv`; mask [B, 1, T, >= S0 + T]
        bool (True: attend) or None (causal). Appends to `kv` as the module path does."""
        ext, (b, t) = self.ext, ids.shape
        x = self.embed(ids)  # [B, T, H]
        cos, sin = self.rotary(x, positions)  # [B, T, D] each
        outputs = {-1: x} if -1 in taps else {}  # tap -1: the embedding's output
        x = x.view(b * t, -1)  # [M, H]: every projection and norm works on rows
        n0 = kv.layers[0].keys.shape[2]
        s = n0 + t
        if mask is not None:
            mask = mask[:, :, :, :s]
        elif t > 1:  # causal: row r sees the cache and rows up to r
            mask = (torch.arange(s) <= n0 + torch.arange(t)[:, None]).expand(b, 1, t, s)  # [B, 1, T, S]
        else:
            mask = _NONE
        d = self.head_dim
        for i, (layer, cache) in enumerate(zip(self.layers, kv.layers)):
            h = ext.rms_norm(x, layer.input_norm.weight, layer.input_norm.eps)
            if len(layer.qkv) == 1:
                q, k, v = layer.qkv[0](h).split_with_sizes(layer.splits, dim=-1)  # [M, Hq*D], [M, Hk*D] x 2
            else:
                q, k, v = (proj(h) for proj in layer.qkv)
            kbuf, vbuf, n = kv_room(cache, b, k.shape[-1] // d, t, d, d, x)  # [B, Hk, capacity, D] x 2
            # [B, Hq, T, D]; rope(K) and V go into the buffers
            q = ext.rope_append(q.view(b, t, -1), k.view(b, t, -1), v.view(b, t, -1), d, cos, sin, kbuf, vbuf, n)
            cache.keys, cache.values = kbuf[:, :, :n + t], vbuf[:, :, :n + t]
            a = ext.attention(q, cache.keys, cache.values, mask, self.scaling)  # [B, T, Hq, D]
            x = x + layer.o_proj(a.view(b * t, -1))
            h = ext.rms_norm(x, layer.post_norm.weight, layer.post_norm.eps)
            if len(layer.gate_up) == 1:
                gate, up = layer.gate_up[0](h).split_with_sizes(layer.split_mlp, dim=-1)  # [M, I] each
            else:
                gate, up = (proj(h) for proj in layer.gate_up)
            x = x + layer.down(layer.act(gate) * up)
            if i in taps:
                outputs[i] = x.view(b, t, -1)
        x = x.view(b, t, -1)
        final = len(self.layers) - 1
        if final in taps:
            outputs[final] = ext.rms_norm(x, self.norm.weight, self.norm.eps)
            return StepOutput(outputs[final][:, t - (t if keep is None else keep):], outputs)
        last = x[:, t - (t if keep is None else keep):]  # the final norm is row by row: only the rows kept
        return StepOutput(ext.rms_norm(last, self.norm.weight, self.norm.eps), outputs)


@torch.inference_mode()
def matches_model(step: LlamaStep, model: nn.Module) -> bool:
    """Whether `step` computes bitwise what the model's own forward does, on a few fixed tokens: a
    block of three after a cached prefix of four, then one token (its last hidden state, every
    layer's output and the cache's K/V)."""
    base = model.base_model
    v = int(base.embed_tokens.weight.shape[0])
    ids = torch.tensor([[(7 * i + 3) % v for i in range(7)]], device=base.embed_tokens.weight.device)
    try:
        return all(_agrees(step, base, ids, rows) for rows in (3, 1))
    except (RuntimeError, ValueError):  # a shape the kernels refuse (a head size not a multiple of 8)
        return False


def _agrees(step: LlamaStep, base: nn.Module, ids: torch.Tensor, rows: int) -> bool:
    from transformers import DynamicCache

    kv = DynamicCache(config=base.config)
    base(input_ids=ids[:, :4], past_key_values=kv, use_cache=True)
    block, pos = ids[:, 4:4 + rows], torch.arange(4, 4 + rows, device=ids.device)[None]
    want = base(input_ids=block, position_ids=pos, past_key_values=kv, use_cache=True, output_hidden_states=True)
    cached = [(l.keys.clone(), l.values.clone()) for l in kv.layers]
    crop(kv, 4)
    every = range(len(step.layers))
    got = step.forward(block, kv, pos, None, taps=every)
    return torch.equal(got.hidden, want.last_hidden_state) \
        and all(torch.equal(got.layers[i], want.hidden_states[i + 1]) for i in every) \
        and all(torch.equal(l.keys, k) and torch.equal(l.values, v) for l, (k, v) in zip(kv.layers, cached))
