"""Llama attention and gated MLPs over GGUF blocks with their projections fused (issue 50).

A decode step's few rows make each linear layer's cost mostly the call (threads woken, panels
walked, ~40 us), not its bytes. Q, K and V read the same input, and so do an MLP's gate and up:
their blocks, panels of 16 output features, are stacked into one `BlockLinear` and the result split
along the features. Each output is still one thread's sum over the same blocks in the same order,
so every value is bitwise what the separate layers gave (tests/test_gguf_blocks.py): 4 kernel
calls a layer instead of 7.

The modules are swapped in for transformers' own where its class is one whose forward they repeat
(`FUSED_ATTENTION`, `FUSED_MLP`) and the projections are blocks of one kind; anything else is left
as it is.
"""

from __future__ import annotations

import torch
import transformers.models.llama.modeling_llama as _llama  # the forward BlockAttention repeats
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..ops.gguf_blocks import BlockPanels
from .gguf_target import BlockLinear

FUSED_ATTENTION = ("LlamaAttention",)  # forward: q, k, v, RoPE, cache update, attention interface, o
FUSED_MLP = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")  # forward: down(act(gate(x)) * up(x))


def stack(layers: list[BlockLinear]) -> BlockLinear | None:
    """One BlockLinear computing `layers`' outputs side by side, or None where they cannot stack
    (kinds, input widths or biases differ, or a layer's outputs do not fill whole panels)."""
    first = layers[0].panels
    if any(l.panels.kind != first.kind or l.in_features != first.in_features for l in layers) \
            or any(l.out_features % 16 for l in layers[:-1]) or len({l.bias is None for l in layers}) > 1:
        return None

    def cat(name):
        parts = [getattr(l.panels, name) for l in layers]
        return None if parts[0] is None else torch.cat(parts)  # [P, ...]: panels are independent

    panels = BlockPanels(first.kind, cat("codes"), cat("d"), cat("m"), sum(l.out_features for l in layers),
                         first.in_features)
    bias = None if layers[0].bias is None else torch.cat([l.bias for l in layers])
    return BlockLinear(panels, bias)


class BlockAttention(nn.Module):
    """transformers' LlamaAttention.forward with Q, K and V from one stacked BlockLinear."""

    def __init__(self, attn: nn.Module, qkv: BlockLinear):
        super().__init__()
        self.config, self.layer_idx, self.head_dim = attn.config, attn.layer_idx, attn.head_dim
        self.num_key_value_groups, self.scaling = attn.num_key_value_groups, attn.scaling
        self.attention_dropout, self.is_causal = attn.attention_dropout, attn.is_causal
        self.qkv, self.o_proj = qkv, attn.o_proj
        self.splits = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = self.qkv(hidden_states).split(self.splits, dim=-1)  # [B, T, Hq*D], [B, T, Hk*D] x 2
        q = q.reshape(hidden_shape).transpose(1, 2)  # [B, Hq, T, D]
        k = k.reshape(hidden_shape).transpose(1, 2)  # [B, Hk, T, D]
        v = v.reshape(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = _llama.apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          _llama.eager_attention_forward)
        out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class BlockMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up from one stacked BlockLinear."""

    def __init__(self, mlp: nn.Module, gate_up: BlockLinear):
        super().__init__()
        self.gate_up, self.down_proj, self.act_fn = gate_up, mlp.down_proj, mlp.act_fn
        self.width = mlp.gate_proj.out_features

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.width, dim=-1)  # [..., I] each
        return self.down_proj(self.act_fn(gate) * up)


def fuse_projections(model: nn.Module) -> int:
    """Swaps each attention and MLP of `model` whose projections are blocks of one kind for the
    stacked modules above; returns how many were swapped."""
    swaps = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in FUSED_ATTENTION and all(isinstance(getattr(module, p, None), BlockLinear)
                                           for p in ("q_proj", "k_proj", "v_proj")):
            qkv = stack([module.q_proj, module.k_proj, module.v_proj])
            if qkv is not None:
                swaps.append((name, BlockAttention(module, qkv)))
        elif kind in FUSED_MLP and all(isinstance(getattr(module, p, None), BlockLinear)
                                       for p in ("gate_proj", "up_proj")):
            gate_up = stack([module.gate_proj, module.up_proj])
            if gate_up is not None:
                swaps.append((name, BlockMLP(module, gate_up)))
    modules = dict(model.named_modules())
    for name, new in swaps:
        parent, _, attr = name.rpartition(".")
        setattr(modules[parent] if parent else model, attr, new)
    return len(swaps)
