"""The draft model: cached incremental forward, the z-lab checkpoint format, the reference."""

import json

import pytest
import torch

from blockdraft.checkpoint import load_draft, save_draft
from blockdraft.draft import DraftCache, default_target_layer_ids

from conftest import tiny_draft, tiny_target


def test_tap_ids_follow_the_paper_formula():
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(30, 1) == [15]


def test_cached_incremental_forward_equals_from_scratch():
    target = tiny_target("qwen3")
    draft = tiny_draft(target, block_size=6)
    torch.manual_seed(0)
    taps = torch.randn(1, 20, 3 * 64)
    block = torch.randn(1, 6, 64)
    positions = torch.arange(20, 26)
    with torch.no_grad():
        scratch = draft(block, positions, taps, torch.arange(20))
        cache = DraftCache(len(draft.layers))
        for lo, hi in [(0, 7), (7, 8), (8, 15), (15, 20)]:  # context arrives in steps
            out = draft(block, positions, taps[:, lo:hi], torch.arange(lo, hi), cache)
        assert cache.length == 20
    torch.testing.assert_close(out, scratch, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip(tmp_path):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    save_draft(draft, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["target_layer_ids"] == draft.cfg.target_layer_ids
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and "layers.0.self_attn.q_norm.weight" in keys
    assert not any(k.startswith(("model.", "embed", "lm_head")) for k in keys)
    again = load_draft(tmp_path / "d")
    for (k, a), (_, b) in zip(draft.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k


def test_reference_dflash_loads_our_checkpoint_and_agrees(tmp_path):
    """The PyPI package dflash==0.1.0's DFlashDraftModel loads our directory unchanged and gives
    the same draft logits for the same context and block."""
    pytest.importorskip("dflash")
    from dflash.model import DFlashDraftModel

    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=8)
    save_draft(draft, tmp_path / "d")
    ref = DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32).eval()
    assert ref.target_layer_ids == draft.cfg.target_layer_ids
    assert ref.block_size == 8 and ref.mask_token_id == draft.cfg.mask_token_id
    torch.manual_seed(0)
    ctx = 11
    taps = torch.randn(1, ctx, 3 * 64)
    ids = torch.tensor([[5] + [draft.cfg.mask_token_id] * 7])
    emb = target.embed_tokens(ids)
    with torch.no_grad():
        ours = target.lm_head(draft(emb, torch.arange(ctx, ctx + 8), taps, torch.arange(ctx)))
        theirs = target.lm_head(ref(position_ids=torch.arange(ctx + 8)[None], noise_embedding=emb,
                                    target_hidden=taps))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
