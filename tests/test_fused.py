"""The few-row extension's other kernels: bf16- and int8-stored panels (the drafter's weights), the fused
RMSNorm (ops/norms.py) and the drafter's fused per-head norm and RoPE."""

import pytest
import torch
from torch import nn

from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.ops import few_rows
from blockdraft.models.draft import DraftCache, RMSNorm, apply_rope, rope_cos_sin
from blockdraft.ops.norms import FusedRMSNorm, fuse_norms, unfuse_norms
from blockdraft.ops.precision import draft_precision, fast_draft_dtype
from blockdraft.ops.switch import use_packed

from conftest import tiny_draft, tiny_target

needs_few_rows = pytest.mark.skipif(not few_rows.available(), reason="the few-row kernel cannot run on this machine")
CPU = torch.device("cpu")


@needs_few_rows
@pytest.mark.parametrize("n_in,n_out", [(96, 300), (37, 50), (576, 192), (5, 1)])
def test_bf16_panels_widen_exactly_and_keep_rows_independent(n_in, n_out):
    """bf16 panels compute with the weight rounded to bf16, in fp32: the float64 product of that
    rounded weight to fp32 rounding, and each row bitwise what it is alone."""
    torch.manual_seed(n_in)
    w = torch.randn(n_out, n_in)
    panels = few_rows.pack(w, torch.bfloat16)
    assert panels.dtype == torch.bfloat16
    x = torch.randn(24, n_in)
    alone = torch.cat([few_rows.linear(x[i:i + 1], panels, n_out) for i in range(len(x))])
    exact = (x.double() @ w.to(torch.bfloat16).double().T).float()
    assert (alone - exact).abs().max() < 1e-4 * max(1.0, n_in ** 0.5)
    assert (alone - (x @ w.T)).abs().max() > 0  # it is the rounded weight, not the fp32 one
    for m in (1, 2, 3, 5, 6, 7, 13, 16, 24):
        assert torch.equal(few_rows.linear(x[:m], panels, n_out), alone[:m]), m
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        few_rows.pack(w, torch.float16)


@needs_few_rows
@pytest.mark.parametrize("n_in,n_out", [(96, 300), (37, 50), (576, 192), (5, 1)])
def test_int8_panels_compute_the_dequantized_weight_and_keep_rows_independent(n_in, n_out):
    """int8 panels: the float64 product of the dequantized weight (int8 times its row's scale) to
    fp32 rounding, each row bitwise what it is alone; a row of zeros stays zeros."""
    torch.manual_seed(n_in)
    w = torch.randn(n_out + 1, n_in)
    w[0] = 0.0
    n_out += 1
    q, scales = few_rows.quantize_int8(w)
    assert q.dtype == torch.int8 and scales[0] == 0 and bool((q[1:].abs().amax(1) == 127).all())
    dequantized = q.double() * scales.double()[:, None]
    assert (dequantized - w.double()).abs().max() <= scales.max() / 2 + 1e-6  # rounded to nearest
    panels = few_rows.pack(w, torch.int8)
    assert panels.data.dtype == torch.int8
    x = torch.randn(24, n_in)
    alone = torch.cat([few_rows.linear(x[i:i + 1], panels, n_out) for i in range(len(x))])
    exact = (x.double() @ dequantized.T).float()
    assert (alone - exact).abs().max() < 1e-4 * max(1.0, n_in ** 0.5)
    assert torch.equal(alone[:, 0], torch.zeros(len(x)))
    for m in (1, 2, 3, 5, 6, 7, 13, 16, 24):
        assert torch.equal(few_rows.linear(x[:m], panels, n_out), alone[:m]), m


@needs_few_rows
@pytest.mark.parametrize("b,hq,hkv,t,s,d", [(1, 9, 3, 1, 300, 64), (1, 9, 3, 3, 40, 64), (2, 4, 4, 5, 37, 16),
                                             (1, 8, 2, 16, 129, 128), (3, 2, 1, 2, 9, 24)])
def test_few_row_attention_is_sdpa_and_each_row_sees_only_its_keys(b, hq, hkv, t, s, d):
    """The few-row attention equals SDPA (to fp32 rounding) on cache views with spare room, with and
    without a mask; each row equals its query alone against its visible keys only, bit for bit (a
    tree's node against its path, a block's row against a one-token step); no visible key: zeros."""
    import torch.nn.functional as F

    torch.manual_seed(t * s)
    q = torch.randn(b, hq, t, d)
    k_buf, v_buf = torch.randn(b, hkv, s + 7, d), torch.randn(b, hkv, s + 7, d)
    k, v = k_buf[:, :, :s], v_buf[:, :, :s]  # strided views, as a cache's buffer gives
    mask = torch.rand(b, 1, t, s) > 0.4
    mask[..., 0] = True
    ours = few_rows.attention(q, k, v, mask)
    assert ours.shape == (b, t, hq, d)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    everything = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(few_rows.attention(q, k, v), everything, atol=1e-5, rtol=1e-5)
    for r in range(b):
        for i in range(t):
            seen = mask[r, 0, i].nonzero()[:, 0]
            alone = few_rows.attention(q[r:r + 1, :, i:i + 1], k[r:r + 1, :, seen], v[r:r + 1, :, seen])
            assert torch.equal(alone[0, 0], ours[r, i]), (r, i)
    mask[0, 0, 0] = False
    assert torch.equal(few_rows.attention(q, k, v, mask)[0, 0], torch.zeros(hq, d))


@needs_few_rows
@pytest.mark.parametrize("shape", [(1, 4, 576), (3, 9, 64), (300, 96), (2, 5, 3)])
def test_fused_rms_norm_matches_the_module_and_keeps_rows_independent(shape):
    torch.manual_seed(len(shape))
    norm = RMSNorm(shape[-1], 1e-5)
    norm.weight.data = torch.randn(shape[-1])
    x = torch.randn(*shape) * 4
    with torch.no_grad():
        fused = few_rows.rms_norm(x, norm.weight, 1e-5)
        assert torch.allclose(fused, norm(x), rtol=1e-5, atol=1e-6)
    rows = x.reshape(-1, shape[-1])
    whole = few_rows.rms_norm(rows, norm.weight, 1e-5)
    for i in range(0, len(rows), max(1, len(rows) // 7)):
        assert torch.equal(few_rows.rms_norm(rows[i:i + 1], norm.weight, 1e-5)[0], whole[i])


@needs_few_rows
@pytest.mark.parametrize("batched", [False, True])
def test_fused_norm_rope_is_the_norm_then_rope(batched):
    torch.manual_seed(0)
    b, t, heads, d = 2, 5, 3, 16
    norm = RMSNorm(d, 1e-6)
    norm.weight.data = torch.randn(d)
    x = torch.randn(b, t, heads, d)
    positions = torch.tensor([[7, 8, 9, 10, 11], [3, 4, 5, 6, 7]]) if batched else torch.arange(20, 25)
    cos, sin = rope_cos_sin(positions, d, 10000.0, torch.float32)  # [B, 1, T, D] or [T, D]
    with torch.no_grad():
        want = apply_rope(norm(x).transpose(1, 2), (cos, sin))
    c, s = (cos[:, 0], sin[:, 0]) if batched else (cos[None], sin[None])
    got = few_rows.norm_rope(x, norm.weight, 1e-6, c, s)
    assert got.shape == (b, heads, t, d) and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


class _OnePlusNorm(nn.Module):
    """A Gemma-style RMSNorm (weight applied as 1 + w): the fused kernel does not reproduce it."""

    def __init__(self, dim):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.randn(dim)), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


_OnePlusNorm.__name__ = "GemmaRMSNorm"


@needs_few_rows
def test_fuse_norms_takes_the_norms_it_reproduces_and_leaves_the_others():
    target = tiny_target("llama")  # Target fuses its norms (and packs its linear layers)
    norms = [m for m in target.model.modules() if "RMSNorm" in type(m).__name__]
    assert norms and all(isinstance(m, FusedRMSNorm) for m in norms)
    norm = RMSNorm(32, 1e-5)
    other = nn.Sequential(_OnePlusNorm(32), norm)
    keys = list(other.state_dict())
    assert fuse_norms(other) == 1
    assert type(other[0]) is _OnePlusNorm and isinstance(other[1], FusedRMSNorm) and other[1].replaced is norm
    assert other[1].weight is norm.weight and list(other.state_dict()) == keys  # the same parameter, the same keys
    x = torch.randn(3, 32)
    with torch.inference_mode():
        fused = other[1](x)
        with use_packed(False):
            assert torch.equal(other[1](x), norm(x))  # as written, within use_packed(False)
    assert torch.allclose(fused, norm(x), rtol=1e-5, atol=1e-6)
    y = torch.randn(3, 32, requires_grad=True)
    other[1](y).sum().backward()  # training runs the module's own forward, with its gradient
    assert y.grad is not None and norm.weight.grad is not None
    unfuse_norms(other)
    assert other[1] is norm


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fused_norms_keep_speculative_output_identical(kind):
    """The target with fused norms (its default) decodes speculatively what it decodes plainly, and
    plainly what it decodes with transformers' own norms and kernels (to the greedy tokens)."""
    target = tiny_target(kind)
    cfg = GenerationConfig(max_new_tokens=40, block_size=6, stop_token_ids=(), lookup=False)
    plain = Engine(target).generate([5, 17, 33, 2], cfg).token_ids
    with use_packed(False):
        assert Engine(target).generate([5, 17, 33, 2], cfg).token_ids == plain
    assert Engine(target, tiny_draft(target, block_size=6)).generate([5, 17, 33, 2], cfg).token_ids == plain


def _stored(weight: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """The weight that panels of this storage hold, in fp32."""
    if storage == torch.bfloat16:
        return weight.to(torch.bfloat16).float()
    q, scales = few_rows.quantize_int8(weight)
    return q.float() * scales[:, None]


@needs_few_rows
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.int8])
def test_a_drafter_with_bf16_or_int8_weights_keeps_greedy_output_and_computes_them_in_fp32(storage, monkeypatch):
    """Where the few-row kernel runs, bf16 means bf16 weights computed in fp32, even on a CPU with
    native bf16 (forced either way here), and `auto` picks int8 weights, computed in fp32 too. Greedy output stays plain decoding's,
    and the fused drafter computes what the drafter as written does with the same stored weights."""
    for native in (False, True):
        monkeypatch.setattr("blockdraft.ops.precision.native_cpu_bf16", lambda: native)
        assert draft_precision(CPU, storage) == (torch.float32, storage)
        assert draft_precision(CPU, torch.float32) == (torch.float32, None)
        assert fast_draft_dtype(CPU, torch.float32) == torch.int8
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=6)
    cfg = GenerationConfig(max_new_tokens=40, block_size=6, stop_token_ids=(), lookup=False)
    plain = Engine(target).generate([5, 17, 33, 2], cfg).token_ids
    engine = Engine(target, draft, draft_dtype=storage)
    assert draft.dtype == torch.float32 and draft.weight_storage == storage
    assert draft.precision == f"{storage} weights, torch.float32 compute"
    assert engine.generate([5, 17, 33, 2], cfg).token_ids == plain
    head = draft.head_for(target.lm_head)
    assert head is not target.lm_head
    for layer in (head.rows, draft.layers[0].mlp.up_proj, draft.layers[0].self_attn.q_proj):
        panels = layer.panels
        assert (panels.data if isinstance(panels, few_rows.Int8Panels) else panels).dtype == storage
    with torch.inference_mode():
        out = target.forward(torch.tensor([[5, 17, 33, 2, 9]]), target.new_cache(), draft.cfg.target_layer_ids)
        fused = draft.block_hidden(target.embed_tokens, DraftCache(len(draft.layers)), out.taps, 3, 5, 6)
        for m in draft.modules():
            if isinstance(m, nn.Linear):
                m.weight.data = _stored(m.weight, storage)
        with use_packed(False):
            written = draft.block_hidden(target.embed_tokens, DraftCache(len(draft.layers)), out.taps, 3, 5, 6)
    assert torch.allclose(fused, written, rtol=1e-4, atol=1e-4)


def test_int8_drafter_weights_are_refused_where_the_few_row_kernel_cannot_run(monkeypatch):
    from blockdraft.errors import BlockdraftError

    monkeypatch.setattr(few_rows, "runs_on", lambda device, dtype: False)
    with pytest.raises(BlockdraftError, match="int8 drafter weights need the few-row kernel"):
        draft_precision(CPU, torch.int8)


def test_auto_draft_dtype_without_the_few_row_kernel_is_native_bf16_or_the_targets(monkeypatch):
    monkeypatch.setattr(few_rows, "runs_on", lambda device, dtype: False)
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr("blockdraft.ops.precision.native_bf16_packing", lambda device: native)
        assert fast_draft_dtype(CPU, torch.float32) == expected
    assert draft_precision(CPU, torch.bfloat16) == (torch.bfloat16, None)  # oneDNN's (or emulated) bf16


@needs_few_rows
@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN computes no bf16 on this CPU")
def test_a_drafters_calls_of_many_rows_run_onednn_bf16_where_the_cpu_has_it(monkeypatch):
    """With bf16 instructions (forced here), a drafter's layer with int8 panels runs calls of more
    than MANY_ROWS rows in oneDNN's bf16 arithmetic (the weights rounded to bf16) and fewer rows on
    its panels; greedy output stays plain decoding's with a prompt long enough for both."""
    from blockdraft.ops.packed import MANY_ROWS

    monkeypatch.setattr("blockdraft.ops.precision.native_cpu_bf16", lambda: True)
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=6)
    prompt = [(7 * i + 3) % 90 + 1 for i in range(3 * MANY_ROWS)]
    cfg = GenerationConfig(max_new_tokens=24, block_size=6, stop_token_ids=(), lookup=False)
    plain = Engine(target).generate(prompt, cfg).token_ids
    assert Engine(target, draft, draft_dtype=torch.int8).generate(prompt, cfg).token_ids == plain
    assert draft.fc.many is not None  # the prompt's context rows went through fc at once
    assert draft.layers[0].mlp.up_proj.many is None  # a block's rows only: the panels
    layer = draft.layers[0].mlp.up_proj
    with torch.inference_mode():
        x = torch.randn(MANY_ROWS + 1, layer.in_features)
        want = (x.bfloat16() @ layer.weight.bfloat16().T).float()
        assert torch.allclose(layer(x), want, rtol=2e-2, atol=2e-2)
        few = layer(x[:MANY_ROWS])  # the int8 panels
        assert torch.allclose(few, x[:MANY_ROWS] @ layer.weight.T, rtol=5e-2, atol=5e-2)
