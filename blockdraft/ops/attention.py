"""Attention on the CPU without copying K/V per query-head group (`share_kv_heads`).

transformers' SDPA path copies a grouped-query layer's whole K/V cache once per query-head group
before every call that has a mask, because PyTorch's CUDA kernels do not share heads under a
mask. The CPU kernel does, with the same result bit for bit, and every batch step and tree verify
has a mask: SmolLM2 (3 K/V heads for 9 query heads) copied 3x its cache per layer, the largest
single cost of a step of 16 sequences (`python scripts/batch_forward.py`). A step's few fp32 rows
run the few-row attention kernel (few_rows.attention) instead. The function is registered with
transformers' attention interface under its own name (an explicit implementation the model is
switched to, not a patched method).
"""

from __future__ import annotations

import torch
from torch import nn

from . import few_rows
from .switch import packed_enabled

SHARED_KV_ATTENTION = "blockdraft_sdpa"  # the name our attention function is registered under


def _shared_kv_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                    **kwargs):
    """transformers' SDPA attention, except that a masked call of a grouped-query layer on the CPU
    lets the kernel share each K/V head among its query heads (`enable_gqa`) instead of repeating
    K/V first. query [B, Hq, T, D], key/value [B, Hkv, S, D]; returns [B, T, Hq, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if few_row_attention_applies(query, key, value, attention_mask, dropout, kwargs):
        mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]  # [B, 1, T, S]
        return few_rows.attention(query, key, value, mask, scaling), None
    if attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1 or key.device.type != "cpu" \
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions") \
            or not packed_enabled():  # use_packed(False): transformers as it is
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask[:, :, :, : key.shape[-2]]  # [B, 1, T, S]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def few_row_attention_applies(query, key, value, attention_mask, dropout, kwargs) -> bool:
    """Whether a transformers attention call is one `few_rows.attention` computes as SDPA would: a
    step's few fp32 rows on the CPU, a bool mask (or a single row seeing the whole cache), no
    dropout, no position bias. Every decode step's attention then runs it, one token or a block,
    so a block's rows compute what one-token rows do; a prompt's prefill keeps SDPA."""
    rows = query.shape[2]
    return packed_enabled() and rows <= few_rows.MAX_ROWS and not dropout \
        and kwargs.get("position_bias") is None and not kwargs.get("output_attentions") \
        and (attention_mask.dtype == torch.bool if attention_mask is not None else rows == 1) \
        and few_rows.attention_fits(query, key, value)


def share_kv_heads(model: nn.Module) -> bool:
    """Switch a transformers model that runs SDPA attention to `_shared_kv_sdpa` (its masks are
    made as SDPA's). Models on another attention implementation keep it. True if switched."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation") \
            or _branches_on_sdpa(model):
        return False
    AttentionInterface.register(SHARED_KV_ATTENTION, _shared_kv_sdpa)
    AttentionMaskInterface.register(SHARED_KV_ATTENTION, sdpa_mask)
    model.set_attn_implementation(SHARED_KV_ATTENTION)
    return config._attn_implementation == SHARED_KV_ATTENTION


def _branches_on_sdpa(model: nn.Module) -> bool:
    """Whether the model's own source names "sdpa" (DeepSeek-V3.2's sparse attention, gpt-oss's
    sinks, Qwen3.5 ... decide what they compute by the implementation's name): such a model keeps
    SDPA under its own name, or another name would change what it computes."""
    import inspect
    import sys

    for name in {type(m).__module__ for m in model.modules()}:
        if name.startswith("torch."):
            continue
        module = sys.modules.get(name)
        if module is None:
            return True
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            return True  # unknown: keep what transformers chose
        if '"sdpa"' in source or "'sdpa'" in source:
            return True
    return False
