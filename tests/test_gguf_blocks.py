"""GGUF's quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) in the few-row kernel (ops/gguf_blocks.py): every kind dequantizes
to exactly the `gguf` package's fp32 weights, a layer's output is bitwise the fp32 kernel's on
those weights, and a row's output is the same at every row count (issue 50)."""

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from blockdraft.ops import few_rows
from blockdraft.ops.gguf_blocks import KINDS, block_linear, dequantize, dequantize_torch, pack_blocks

pytestmark = pytest.mark.skipif(not few_rows.available(), reason="the few-row kernel does not run here")


# where each kind keeps its fp16 scales within a block (the rest are codes and 6- or 8-bit sub-scales)
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def _quantized(kind: str, n: int, k: int, seed: int = 0):
    """Random blocks of `kind` (the `gguf` package quantizes a random weight where it can; the
    K-quants, which it cannot quantize, are random bytes with finite fp16 scales):
    (raw blocks, gguf's dequantized fp32)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[kind]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
        w[0] = 0.0  # a block of zeros: d = 0
        raw = quants.quantize(w, qtype)
    else:
        spec = KINDS[kind]
        raw = rng.integers(0, 256, (n, k // spec.block, spec.nbytes), dtype=np.uint8)
        for at in HALVES[kind]:
            scale = (rng.uniform(1e-4, 0.05, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])).astype(np.float16)
            raw[..., at:at + 2] = scale[..., None].view(np.uint8)
        raw = raw.reshape(n, -1)
    return raw, torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32).reshape(n, k))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("n, k", [(48, 256), (37, 512), (200, 768)])
def test_blocks_compute_exactly_what_the_fp32_kernel_does_on_ggufs_dequantization(kind, n, k):
    raw, weight = _quantized(kind, n, k)
    panels = pack_blocks(raw, kind, n, k)
    dense = few_rows.pack(weight)
    x = torch.randn(64, k)
    got = block_linear(x, panels)
    assert torch.equal(got, few_rows.linear(x, dense, n))
    # the identity reads back every dequantized weight: each output is then one weight
    eye = torch.eye(k)
    assert torch.equal(block_linear(eye, panels).T, weight)
    assert torch.equal(dequantize(panels), weight)  # in one pass by the extension where it has AVX-512
    assert torch.equal(dequantize_torch(panels), weight)
    for rows in (1, 2, 3, 5, 7, 16, 17, 33):  # a row's result does not depend on the rows beside it
        assert torch.equal(block_linear(x[:rows], panels), got[:rows])
    assert torch.equal(block_linear(x[40:41], panels), got[40:41])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_avx512_kernel_computes_bitwise_what_the_avx2_one_does(kind):
    """csrc/blocks512.cpp, where the CPU has AVX-512: every row count up to 64 (its tiles of 1 to 8
    rows and 1, 2 or 4 panels), a width not a multiple of 16 (a masked store)."""
    ext = few_rows.library()
    if not ext.set_avx512(True):
        pytest.skip("this CPU has no AVX-512")
    raw, _ = _quantized(kind, 200, 768)
    panels = pack_blocks(raw, kind, 200, 768)
    x = torch.randn(64, 768)
    try:
        fast = [block_linear(x[:rows], panels) for rows in range(1, 65)]
        ext.set_avx512(False)
        assert all(torch.equal(got, block_linear(x[:rows], panels)) for rows, got in enumerate(fast, 1))
    finally:
        ext.set_avx512(os.environ.get("BLOCKDRAFT_AVX512", "1") != "0")


def test_a_weight_streams_at_most_a_third_of_its_fp32_bytes():
    for kind, limit in (("Q4_0", 0.16), ("Q4_1", 0.16), ("Q8_0", 0.27), ("Q4_K", 0.19), ("Q6_K", 0.32)):
        raw, _ = _quantized(kind, 256, 768)
        assert pack_blocks(raw, kind, 256, 768).nbytes <= limit * 256 * 768 * 4, kind


def test_bad_shapes_and_kinds_are_refused():
    raw, _ = _quantized("Q4_1", 16, 64)
    with pytest.raises(ValueError, match="block kind"):
        pack_blocks(raw, "Q5_K", 16, 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        pack_blocks(raw, "Q4_K", 16, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_blocks(raw, "Q4_1", 16, 60)


@pytest.mark.slow
def test_smollm2_in_its_gguf_blocks_decodes_exactly_as_its_fp32_weights(monkeypatch):
    """The bundled target with its 211 linear layers in GGUF blocks (210 Q4_1, the tied head Q8_0):
    the same greedy tokens as the fp32 target, plain and speculative (trees, lookup), and as
    transformers' `generate` on the block model, and the same logits bit for bit."""
    from blockdraft.cli import bundled_drafter
    from blockdraft.decoding.engine import Engine, GenerationConfig
    from blockdraft.models.checkpoint import load_draft
    from blockdraft.models.gguf_target import BlockLinear
    from blockdraft.models.target import load_target, resolve_target_path

    torch.set_num_threads(2)
    dense = load_target("smollm2-135m", device="cpu")
    monkeypatch.setenv("BLOCKDRAFT_GGUF_BLOCKS", "1")
    blocks = load_target("smollm2-135m", device="cpu")
    from blockdraft.models.block_layers import BlockAttention, BlockMLP

    # 210 Q4_1 layers and the tied Q8_0 head; each layer's Q, K, V and its gate and up stacked
    assert sum(isinstance(m, BlockLinear) for m in blocks.model.modules()) == 30 * 4 + 1
    assert sum(isinstance(m, (BlockAttention, BlockMLP)) for m in blocks.model.modules()) == 60
    # the packed blocks' cache stays out of the model directory's top level, which vLLM loads whole
    assert [p.name for p in resolve_target_path("smollm2-135m").glob("*.safetensors")] == ["model.safetensors"]
    ids = blocks.encode_prompt("Write a Python function that reverses a string.", chat=True)
    with torch.inference_mode():
        for rows in (ids, ids[:7]):
            x = torch.tensor([rows])
            assert torch.equal(blocks.model(x).logits, dense.model(x).logits)
    cfg = GenerationConfig(max_new_tokens=40)
    plain = Engine(dense).generate(ids, cfg).token_ids
    assert Engine(blocks).generate(ids, cfg).token_ids == plain
    draft = load_draft(bundled_drafter("smollm2-135m"))
    tree = GenerationConfig(max_new_tokens=40, tree_budget=16, lookup=True)
    assert Engine(blocks, draft).generate(ids, tree).token_ids == plain
    # the drafter's copy of a block head (its vocabulary subset, int8 rows) is made once, not each step
    assert draft.head_for(blocks.lm_head) is draft.head_for(blocks.lm_head)
    with torch.inference_mode():
        hf = blocks.model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=[2],
                                   pad_token_id=2)[0, len(ids):].tolist()
    assert hf[: len(plain)] == plain


def test_packed_blocks_read_back_from_their_cache_as_written(tmp_path):
    """Every kind's panels, offsets included (Q4_1's and Q4_K's), survive the safetensors cache."""
    from blockdraft.models.gguf_target import _Packed, _read_cache, _write_cache

    layers = {f"layer.{kind}": pack_blocks(_quantized(kind, 20, 256)[0], kind, 20, 256) for kind in sorted(KINDS)}
    _write_cache(tmp_path / "blocks.safetensors", _Packed(layers, {"other.weight": "Q5_K"}))
    back = _read_cache(tmp_path / "blocks.safetensors")
    assert back.left == {"other.weight": "Q5_K"} and back.layers.keys() == layers.keys()
    x = torch.randn(3, 256)
    for name, panels in layers.items():
        got = back.layers[name]
        assert (got.kind, got.out_features, got.in_features) == (panels.kind, 20, 256)
        assert (got.m is None) == (panels.m is None), name
        assert torch.equal(block_linear(x, got), block_linear(x, panels)), name


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_stacked_projections_give_each_layers_outputs_bitwise(kind):
    """Q, K, V (or gate and up) stacked into one kernel call (block_layers.py): the same values as
    the separate layers, at every row count; layers that cannot stack are left apart."""
    from blockdraft.models.block_layers import stack
    from blockdraft.models.gguf_target import BlockLinear

    k = 256
    layers = [BlockLinear(pack_blocks(_quantized(kind, n, k, seed=n)[0], kind, n, k), None) for n in (64, 32, 40)]
    both = stack(layers)
    for rows in (1, 3, 16, 64):
        x = torch.randn(rows, k)
        parts = both(x).split([64, 32, 40], dim=-1)
        for layer, part in zip(layers, parts):
            assert torch.equal(part, layer(x))
    other = "Q8_0" if kind != "Q8_0" else "Q4_1"
    mixed = BlockLinear(pack_blocks(_quantized(other, 16, k)[0], other, 16, k), None)
    assert stack([layers[0], mixed]) is None  # kinds differ
    assert stack([layers[2], layers[0]]) is None  # 40 outputs leave a part-filled panel before the next layer


@pytest.mark.slow
def test_any_gguf_file_is_a_target_in_its_blocks(tmp_path, monkeypatch):
    """`--target FILE.gguf`: read once into a cache folder named by the file and its version, its
    linear layers kept in blocks (by default, where the kernel runs), the same greedy text as the
    bundled alias; `blocks=False` and BLOCKDRAFT_GGUF_BLOCKS=0 keep transformers' dequantized
    model; a missing file is refused with its name."""
    import shutil

    from blockdraft.decoding.engine import Engine, GenerationConfig
    from blockdraft.errors import BlockdraftError
    from blockdraft.models.gguf_target import BlockLinear
    from blockdraft.models.target import SMOLLM2_GGUF, load_target, resolve_target_path, smollm2_gguf_dir

    torch.set_num_threads(2)
    monkeypatch.setenv("BLOCKDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BLOCKDRAFT_GGUF_BLOCKS", raising=False)
    path = tmp_path / "my-model.gguf"
    shutil.copy(smollm2_gguf_dir() / SMOLLM2_GGUF, path)
    target = load_target(str(path), device="cpu")
    folder = resolve_target_path(str(path))
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("gguf-my-model-")
    assert any(isinstance(m, BlockLinear) for m in target.model.modules())
    ids = target.encode_prompt("Name three colours.", chat=True)
    cfg = GenerationConfig(max_new_tokens=24)
    dense = load_target(str(path), device="cpu", blocks=False)
    assert not any(isinstance(m, BlockLinear) for m in dense.model.modules())
    assert Engine(target).generate(ids, cfg).token_ids == Engine(dense).generate(ids, cfg).token_ids
    assert not any(isinstance(m, BlockLinear) for m in target.reference_model().modules())  # the hf baseline's
    monkeypatch.setenv("BLOCKDRAFT_GGUF_BLOCKS", "0")
    assert not any(isinstance(m, BlockLinear) for m in load_target(str(path), device="cpu").model.modules())
    with pytest.raises(BlockdraftError, match="no such GGUF file"):
        load_target(str(tmp_path / "missing.gguf"))


def test_a_gradient_flows_through_a_block_layer_as_through_its_fp32_weight():
    """Training a drafter backpropagates through the target's head, a BlockLinear on the CPU: the
    kernel has no backward, so such a call takes the dequantized weight, and the gradient is the
    dense layer's."""
    from blockdraft.models.gguf_target import BlockLinear

    raw, weight = _quantized("Q8_0", 48, 64)
    layer = BlockLinear(pack_blocks(raw, "Q8_0", 48, 64), None)
    x = torch.randn(5, 64, requires_grad=True)
    layer(x).square().sum().backward()
    y = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(y, weight).square().sum().backward()
    assert torch.allclose(x.grad, y.grad)
    with torch.no_grad():  # and without one, the kernel
        assert torch.equal(layer(x), block_linear(x.detach(), layer.panels))


def test_a_long_prompts_rows_take_the_dequantized_weight_and_short_ones_the_kernel():
    """Calls of DENSE_ROWS rows or more (a long prompt's prefill) multiply the dequantized weight
    with oneDNN, as the fp32 target does; fewer rows run the kernel, 64 at a time, each row as alone."""
    from blockdraft.models.gguf_target import DENSE_ROWS, BlockLinear

    raw, weight = _quantized("Q4_1", 48, 256)
    layer = BlockLinear(pack_blocks(raw, "Q4_1", 48, 256), None)
    x = torch.randn(DENSE_ROWS, 256)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, weight))
        short = x[: DENSE_ROWS - 1]
        assert torch.equal(layer(short), torch.cat([block_linear(r[None], layer.panels) for r in short]))
