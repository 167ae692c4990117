"""GGUF's quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) in the few-row kernel (models/gguf_blocks.py): every kind dequantizes
to exactly the `gguf` package's fp32 weights, a layer's output is bitwise the fp32 kernel's on
those weights, and a row's output is the same at every row count (issue 50)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from blockdraft.models import few_rows
from blockdraft.models.gguf_blocks import KINDS, block_linear, dequantize, pack_blocks

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
    assert torch.equal(dequantize(panels), weight)
    for rows in (1, 2, 3, 5, 7, 16, 17, 33):  # a row's result does not depend on the rows beside it
        assert torch.equal(block_linear(x[:rows], panels), got[:rows])
    assert torch.equal(block_linear(x[40:41], panels), got[40:41])


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
    assert sum(isinstance(m, BlockLinear) for m in blocks.model.modules()) == 211
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
