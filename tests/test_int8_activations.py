"""The opt-in int8-activation mode of a GGUF target (ops/int8_activations.py, csrc/q8.cpp):
every block kind computes the int8 products it stands for (each row of x quantized in blocks of 32,
the weights' codes as the `gguf` package dequantizes them), a row's result is bitwise the same at
every row count, and speculative decoding in this mode equals this mode's plain decoding (issue 50)."""

import pytest
import torch
from test_gguf_blocks import _quantized

from blockdraft.errors import BlockdraftError
from blockdraft.evaluation.methods import parse_method
from blockdraft.ops import few_rows, int8_activations
from blockdraft.ops.gguf_blocks import KINDS, block_linear, pack_blocks

pytestmark = pytest.mark.skipif(not int8_activations.available(), reason="no AVX-512 VNNI here")


def _quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel quantizes it, dequantized: per row and block of 32, d = max|x| / 127,
    q = round(x / d) (x times 1 / d, ties to even), d * q."""
    blocks = x.view(x.shape[0], -1, 32)  # [M, K / 32, 32]
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q.double() * d.double()).view_as(x)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_computes_its_int8_products_and_a_row_alone_equals_it_among_others(kind):
    n, k = 200, 768  # 200: a last panel of 8 outputs (a masked store)
    raw, weight = _quantized(kind, n, k)
    panels = pack_blocks(raw, kind, n, k)
    x = torch.randn(64, k) * torch.linspace(0.1, 4, k)  # blocks of different scales
    got = int8_activations.block_linear(x, panels)
    # the exact sum of the dequantized weights times the dequantized int8 activations
    want = _quantize_rows(x) @ weight.double().T
    scale = _quantize_rows(x).abs() @ weight.double().abs().T  # each output's sum of magnitudes: its rounding's scale
    assert ((got.double() - want).abs() <= 1e-5 * scale + 1e-30).all()
    # and near the exact fp32 result: int8 activations lose about 1/254 of each block's largest value
    exact = block_linear(x, panels)
    assert ((got - exact).abs() <= 0.02 * scale.float() + 1e-6).all()
    assert not torch.equal(got, exact)
    for rows in (1, 2, 3, 4, 5, 7, 16, 33):  # a row's result does not depend on the rows beside it
        assert torch.equal(int8_activations.block_linear(x[:rows], panels), got[:rows])
    assert torch.equal(int8_activations.block_linear(x[40:41], panels), got[40:41])


def test_the_mode_is_a_switch_the_block_layers_and_the_bench_follow():
    from blockdraft.models.gguf_target import BlockLinear

    raw, _ = _quantized("Q4_1", 48, 256)
    layer = BlockLinear(pack_blocks(raw, "Q4_1", 48, 256), None)
    x = torch.randn(3, 256)
    with torch.inference_mode():
        exact = layer(x)
        with int8_activations.int8_activations(True):
            assert torch.equal(layer(x), int8_activations.block_linear(x, layer.panels))
        assert torch.equal(layer(x), exact) and not int8_activations.MODE.on
    assert parse_method("dflash+tree16+q8").q8 and parse_method("ar+q8").q8 and not parse_method("ar").q8
    assert parse_method("dflash+tree16+q8").tree_budget == 16
    for refused in ("hf+q8", "oracle+q8"):
        with pytest.raises(BlockdraftError, match="q8"):
            parse_method(refused)


def test_the_bench_refuses_q8_methods_on_a_target_without_blocks():
    from conftest import tiny_target

    from blockdraft.evaluation.bench import run_bench

    with pytest.raises(BlockdraftError, match="GGUF"):
        run_bench(tiny_target("llama"), None, [[1, 2, 3]], methods=("ar", "ar+q8"), max_new_tokens=2, profile=False)


@pytest.mark.slow
def test_smollm2_speculative_decoding_in_int8_mode_equals_its_plain_decoding():
    """The bundled GGUF target with int8 activations: speculative output (trees, lookup) equals this
    mode's plain output token for token; the decode step (llama_step.py) computes what the modules
    compute in this mode too."""
    from blockdraft.cli import bundled_drafter
    from blockdraft.decoding.engine import Engine, GenerationConfig
    from blockdraft.models.checkpoint import load_draft
    from blockdraft.models.target import load_target

    torch.set_num_threads(2)
    target = load_target("smollm2-135m", device="cpu")
    assert target.step is not None and target.dense_loader is not None
    draft = load_draft(bundled_drafter("smollm2-135m"))
    ids = target.encode_prompt("Write a Python function that merges two sorted lists.", chat=True)
    cfg = GenerationConfig(max_new_tokens=48)
    exact = Engine(target).generate(ids, cfg).token_ids
    with int8_activations.int8_activations(True):
        plain = Engine(target).generate(ids, cfg).token_ids
        tree = GenerationConfig(max_new_tokens=48, tree_budget=16, lookup=True)
        assert Engine(target, draft).generate(ids, tree).token_ids == plain
        with torch.inference_mode():
            outs = []
            for step in (target.step, None):
                saved, target.step = target.step, step
                cache = target.new_cache()
                target.forward(torch.tensor([ids]), cache, logits_at=1)
                outs.append(target.forward(torch.tensor([plain[:5]]), cache).logits)
                target.step = saved
            assert torch.equal(outs[0], outs[1])
    assert plain[:8] == exact[:8]  # the same model: the text agrees at first, whatever drifts later
