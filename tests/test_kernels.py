"""The fast forward: packed linear layers (ops/packed.py) and the lazily applied LM head."""

import os

import pytest
import torch
from torch import nn

from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.ops import few_rows
from blockdraft.ops.attention import SHARED_KV_ATTENTION
from blockdraft.ops.packed import is_packed, packing_available, prepack
from blockdraft.ops.precision import draft_precision
from blockdraft.ops.switch import use_packed
from blockdraft.models.target import Target
from blockdraft.decoding.verify import SamplingParams, probs_from_logits, row_chunks, verify_greedy, verify_sampled

from conftest import VOCAB, tiny_draft, tiny_target

needs_packing = pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32),
                                   reason="oneDNN packing is unavailable in this torch build")
needs_few_rows = pytest.mark.skipif(not few_rows.available(), reason="the few-row kernel cannot run on this machine")


@pytest.fixture
def onednn_only(monkeypatch):
    """Layers packed for oneDNN, as on a machine where the few-row kernel cannot run."""
    monkeypatch.setattr(few_rows, "applies", lambda weight: False)


@needs_few_rows
@pytest.mark.parametrize("n_in,n_out", [(96, 300), (37, 50), (576, 192), (1536, 16), (5, 1)])
def test_few_rows_kernel_is_exact_and_bitwise_independent_of_the_row_count(n_in, n_out):
    """Every row of every call equals the same row multiplied alone, bit for bit (a verify
    forward's linear layers compute what one-token forwards do), and the float64 product to fp32
    rounding, for widths that fill no whole panel or vector and row counts across every tile size."""
    torch.manual_seed(n_in)
    w, b = torch.randn(n_out, n_in), torch.randn(n_out)
    panels = few_rows.pack(w)
    x = torch.randn(40, n_in)
    alone = torch.cat([few_rows.linear(x[i:i + 1], panels, n_out, b) for i in range(len(x))])
    exact = (x.double() @ w.double().T + b.double()).float()
    assert (alone - exact).abs().max() < 1e-4 * max(1.0, n_in ** 0.5)
    for m in (*range(1, 14), 16, 17, 24, 32, 40):
        assert torch.equal(few_rows.linear(x[:m], panels, n_out, b), alone[:m]), m
    assert few_rows.linear(x[:6].view(2, 3, n_in), panels, n_out).shape == (2, 3, n_out)


@needs_few_rows
@pytest.mark.parametrize("storage", [None, torch.bfloat16, torch.int8])
def test_the_avx512_panel_kernel_computes_bitwise_what_the_avx2_one_does(storage):
    """csrc/blocks512.cpp's fp32, bf16 and int8 panels (a drafter's; int8 with its scales), where
    the CPU has AVX-512: every row count up to 40, widths that fill no whole panel."""
    ext = few_rows.library()
    if not ext.set_avx512(True):
        pytest.skip("this CPU has no AVX-512")
    torch.manual_seed(1)
    w, x = torch.randn(200, 96), torch.randn(40, 96)
    panels = few_rows.pack(w, storage)
    try:
        fast = [few_rows.linear(x[:m], panels, 200) for m in range(1, 41)]
        ext.set_avx512(False)
        assert all(torch.equal(got, few_rows.linear(x[:m], panels, 200)) for m, got in enumerate(fast, 1))
    finally:
        ext.set_avx512(os.environ.get("BLOCKDRAFT_AVX512", "1") != "0")


@needs_few_rows
def test_prepacked_layer_runs_few_rows_and_the_default_kernel_past_its_rows(monkeypatch):
    torch.manual_seed(0)
    layer = nn.Linear(64, 80)
    layer = prepack(layer)
    monkeypatch.setattr(few_rows, "MAX_ROWS", 8)
    x = torch.randn(12, 64)
    with torch.inference_mode():
        small = layer(x[:8])
        assert layer.panels is not None and layer.packed is None  # no oneDNN copy besides
        assert torch.equal(small, few_rows.linear(x[:8], layer.panels, 80, layer.bias))
        assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))  # 12 rows: past MAX_ROWS


@needs_packing
@pytest.mark.parametrize("kernel", ["few_rows", "onednn"])
def test_packed_rows_are_bitwise_independent_of_the_row_count(monkeypatch, request, kernel):
    from blockdraft.ops import packed as kernels

    if kernel == "few_rows" and not few_rows.available():
        pytest.skip("the few-row kernel cannot run on this machine")
    if kernel == "onednn":
        request.getfixturevalue("onednn_only")
    torch.manual_seed(0)
    layer = nn.Linear(96, 300)
    layer = prepack(layer)
    monkeypatch.setitem(kernels.SMALL_ROWS, (96, 300, torch.float32, torch.get_num_threads()), 1)  # packed always
    x = torch.randn(16, 96)
    with torch.inference_mode():
        all_rows = layer(x)
        for m in (1, 2, 3, 5, 8):
            assert torch.equal(layer(x[:m]), all_rows[:m])  # what makes verify == one-token forwards
        with use_packed(False):
            plain = layer(x)
    assert torch.allclose(plain, all_rows, atol=1e-5)


@needs_packing
def test_calls_below_the_measured_row_count_run_the_default_kernel(monkeypatch, onednn_only):
    """Where the default kernel measured faster at few rows, those calls compute exactly what
    transformers computes; from that count up the packed kernel runs, row-independent as ever."""
    from blockdraft.ops import packed as kernels

    torch.manual_seed(0)
    layer = nn.Linear(96, 300)
    layer = prepack(layer)
    key = (96, 300, torch.float32, torch.get_num_threads())
    x = torch.randn(16, 96)
    with torch.inference_mode():
        monkeypatch.setitem(kernels.SMALL_ROWS, key, 1)
        packed = layer(x)
        monkeypatch.setitem(kernels.SMALL_ROWS, key, 3)
        for m in (1, 2):
            assert torch.equal(layer(x[:m]), nn.functional.linear(x[:m], layer.weight, layer.bias))
        for m in (3, 5, 16):
            assert torch.equal(layer(x[:m]), packed[:m])
    monkeypatch.delitem(kernels.SMALL_ROWS, key)
    swept = set()  # the weights the measurement multiplies by: streamed, not one kept in the cache
    linear = nn.functional.linear
    monkeypatch.setattr(nn.functional, "linear", lambda x, w, *a: swept.add(w.data_ptr()) or linear(x, w, *a))
    monkeypatch.setattr(kernels, "STREAM_BYTES", 40 * 96 * 300 * 4)
    rows = kernels.small_rows(layer.weight, layer.packed)  # measured here, then cached
    assert 1 <= rows <= kernels.SMALL_ROWS_TRIED + 1 and kernels.SMALL_ROWS[key] == rows
    assert len(swept) == 40 and layer.weight.data_ptr() in swept


@needs_packing
def test_packed_layer_follows_weight_changes_and_training():
    layer = nn.Linear(8, 4)
    layer = prepack(layer)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place, as an optimizer step or load_state_dict
    with torch.inference_mode():
        assert torch.allclose(layer(x), nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6)
        assert not torch.allclose(layer(x), before)
    y = layer(x)  # grad mode: the plain layer, so gradients flow
    y.sum().backward()
    assert layer.weight.grad is not None
    layer.double()  # a cast: the packed copy does not apply to float64, the plain layer runs
    with torch.inference_mode():
        assert layer(x.double()).dtype == torch.float64


@needs_packing
def test_target_and_engine_pack_the_target_and_the_drafter():
    target = tiny_target("llama")
    draft = tiny_draft(target)
    Engine(target, draft)
    assert all(is_packed(m) for m in target.model.modules() if isinstance(m, nn.Linear))
    assert all(is_packed(m) for m in draft.modules() if isinstance(m, nn.Linear))


@needs_packing
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_block_forward_matches_one_token_forwards(kind):
    """A verify forward over a block gives each position the logits that decoding one token at a
    time gives, to fp32 rounding: a block's rows and one-token rows may run different linear
    kernels (kernels.small_rows), and attention (SDPA over 1 query or a block) rounds differently."""
    target = tiny_target(kind)
    prompt = torch.tensor([[5, 17, 33, 2, 9, 41]])
    block = torch.tensor([[3, 8, 60, 11, 12, 70, 1, 4]])
    cache = target.new_cache()
    target.forward(prompt, cache, logits_at=1)
    together = target.forward(block, cache).logits[0]
    cache = target.new_cache()
    target.forward(prompt, cache, logits_at=1)
    one_by_one = torch.cat([target.forward(block[:, i:i + 1], cache).logits[0] for i in range(block.shape[1])])
    assert (together - one_by_one).abs().max() < 1e-5
    assert torch.equal(together.argmax(-1), one_by_one.argmax(-1))


def test_row_chunks_cover_every_row_once():
    for rows in range(1, 40):
        for first in (1, 2, 3):
            chunks = list(row_chunks(rows, first))
            assert chunks[0][0] == 0 and chunks[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))


def test_lazy_verification_gives_the_full_verdicts():
    """Chunked (lazy) verification reads fewer rows and reaches exactly the eager verdicts, greedy
    and sampled (same seed, same draws), for every acceptance length."""
    torch.manual_seed(0)
    vocab, n = 11, 9
    params = SamplingParams(temperature=0.8)
    for trial in range(300):
        logits = torch.randn(n + 1, vocab) * 3
        argmax = logits.argmax(-1)
        drafts = argmax[:n].clone()
        cut = trial % (n + 1)
        if cut < n:
            drafts[cut] = (drafts[cut] + 1) % vocab  # first disagreement at `cut`
        read = []

        def rows(a, b):
            read.append((a, b))
            return logits[a:b]

        for first in (1, 2, 4):
            read.clear()
            lazy = verify_greedy(drafts, lambda a, b: rows(a, b).argmax(-1), first_chunk=first)
            assert lazy == verify_greedy(drafts, argmax) and lazy.num_accepted == cut
            assert read[-1][0] <= cut < read[-1][1]  # stopped at the chunk holding the verdict
        p = probs_from_logits(logits, params)
        q = torch.softmax(torch.randn(n, vocab), -1)
        for qq in (q, None):
            eager = verify_sampled(drafts, p, qq, torch.Generator().manual_seed(trial))
            lazy = verify_sampled(drafts, lambda a, b: p[a:b], qq, torch.Generator().manual_seed(trial), first_chunk=2)
            assert lazy == eager


def test_a_model_with_logit_postprocessing_is_not_split_and_stays_lossless():
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                             logits_scaling=4.0, bos_token_id=None, eos_token_id=None,
                                             pad_token_id=None))
    target = Target(model.float(), tokenizer=None, name="tiny-granite")
    assert not target.head_splits  # its logits are the head's divided by logits_scaling
    assert tiny_target("llama").head_splits
    cfg = GenerationConfig(max_new_tokens=30, block_size=5, stop_token_ids=(), lookup=False)
    plain = Engine(target).generate([5, 17, 33, 2], cfg).token_ids
    assert Engine(target, tiny_draft(target)).generate([5, 17, 33, 2], cfg).token_ids == plain


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_bf16_drafter_beside_an_fp32_target_keeps_greedy_output(kind):
    target = tiny_target(kind)
    draft = tiny_draft(target, block_size=6)
    cfg = GenerationConfig(max_new_tokens=40, block_size=6, stop_token_ids=(), lookup=False)
    plain = Engine(target).generate([5, 17, 33, 2], cfg).token_ids
    engine = Engine(target, draft, draft_dtype=torch.bfloat16)
    # bf16 arithmetic where the CPU has it, else bf16 weights computed in fp32 (test_fused.py)
    compute, storage = draft_precision(target.device, torch.bfloat16)
    assert draft.dtype == compute and draft.weight_storage == storage and target.dtype == torch.float32
    head = draft.head_for(target.lm_head)
    assert head is not target.lm_head and head.rows.weight.dtype == compute  # its own head copy
    assert engine.generate([5, 17, 33, 2], cfg).token_ids == plain


def test_dtype_flags_are_checked():
    from blockdraft.cli import build_parser, parse_dtype

    assert parse_dtype("auto") is None and parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "float8"])
    args = build_parser().parse_args(["bench", "--dtype", "bfloat16", "--draft-dtype", "float32"])
    assert args.dtype == "bfloat16" and args.draft_dtype == "float32"
    assert build_parser().parse_args(["bench", "--draft-dtype", "int8"]).draft_dtype == "int8"
    with pytest.raises(SystemExit):  # int8 is for the drafter's weights only
        build_parser().parse_args(["bench", "--dtype", "int8"])


def test_shared_kv_heads_compute_what_transformers_sdpa_does_under_a_mask(monkeypatch):
    """The masked attention of a grouped-query target (4 query heads over 2 K/V heads here) shares
    K/V heads in the kernel instead of copying them per group: the same logits, bit for bit (where
    the few-row attention kernel does not take the call: to fp32 rounding where it does)."""
    target = tiny_target("llama")
    assert target.model.config._attn_implementation == SHARED_KV_ATTENTION
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 12), generator=gen)
    mask = torch.ones(12, 12, dtype=torch.bool).tril().repeat(3, 1, 1)  # [B, T, T]
    mask &= (torch.rand(3, 12, 12, generator=gen) > 0.3) | torch.eye(12, dtype=torch.bool)  # holes, never a row without keys

    def logits(implementation):
        target.model.set_attn_implementation(implementation)
        try:
            with torch.inference_mode():
                return target.model(ids, attention_mask=mask[:, None]).logits
        finally:
            target.model.set_attn_implementation(SHARED_KV_ATTENTION)

    theirs = logits("sdpa")
    if few_rows.available():
        kernel, used = few_rows.attention, []
        monkeypatch.setattr(few_rows, "attention", lambda *a: used.append(1) or kernel(*a))
        assert torch.allclose(logits(SHARED_KV_ATTENTION), theirs, atol=1e-5, rtol=1e-5)
        assert len(used) == target.num_layers
    monkeypatch.setattr("blockdraft.ops.attention.few_row_attention_applies", lambda *a: False)
    assert torch.equal(logits(SHARED_KV_ATTENTION), theirs)
    calls = []
    import transformers.integrations.sdpa_attention as sdpa

    real = sdpa.sdpa_attention_forward
    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode(), use_packed(False):  # the baselines: transformers' own attention, copies and all
        target.model(ids, attention_mask=mask[:, None])
    assert len(calls) == target.num_layers


def test_a_model_whose_source_names_sdpa_keeps_it():
    """DeepSeek-V3.2 computes sparse attention only under the name "sdpa" (dense under any other):
    such a model must keep transformers' own implementation."""
    from families import tiny_family

    assert tiny_family("deepseek-v3.2").model.config._attn_implementation == "sdpa"
    assert tiny_family("llama").model.config._attn_implementation == SHARED_KV_ATTENTION
