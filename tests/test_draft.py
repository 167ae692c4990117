"""The draft model: cached incremental forward, the z-lab checkpoint format, the reference."""

import json

import pytest
import torch

from blockdraft.models.checkpoint import load_draft, save_draft
from blockdraft.models.draft import DraftCache, default_target_layer_ids

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


@pytest.mark.parametrize("sliding", [False, True])
def test_one_draft_forward_for_several_sequences_equals_each_alone(tmp_path, sliding):
    """`blocks_hidden`: three sequences with caches and pending contexts of different lengths in one
    forward draft what each drafts alone, and leave each cache as its own forward would."""
    if sliding:
        target, path = _sliding_drafter(tmp_path)
        draft = load_draft(path)
    else:
        target = tiny_target("llama")
        draft = tiny_draft(target, block_size=6)
    block = 6
    torch.manual_seed(0)
    width = len(draft.cfg.target_layer_ids) * target.hidden_size
    history, pending = [9, 0, 4], [3, 1, 5]  # context already cached, and arriving now
    anchors, positions = [5, 7, 11], [h + p for h, p in zip(history, pending)]
    taps = [torch.randn(1, h + p, width) for h, p in zip(history, pending)]

    def caches():
        out = []
        for t, h in zip(taps, history):
            cache = DraftCache(len(draft.layers))
            if h:
                draft.block_hidden(target.embed_tokens, cache, t[:, :h], 1, h, 2)
            out.append(cache)
        return out

    with torch.inference_mode():
        alone, mine = caches(), caches()
        want = [draft.block_hidden(target.embed_tokens, c, t[:, h:], a, p, block)
                for c, t, h, a, p in zip(alone, taps, history, anchors, positions)]
        got = draft.blocks_hidden(target.embed_tokens, mine, [t[:, h:] for t, h in zip(taps, history)], anchors,
                                  positions, block)
    assert got.shape == (3, block - 1, target.hidden_size)
    for r in range(3):
        torch.testing.assert_close(got[r], want[r], rtol=1e-5, atol=1e-5)
        assert mine[r].length == alone[r].length == positions[r]
        for layer in range(len(draft.layers)):
            n = alone[r].length
            torch.testing.assert_close(mine[r].k[layer][:, :, :n], alone[r].k[layer][:, :, :n], rtol=1e-5, atol=1e-5)


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


def _sliding_drafter(tmp_path, causal=None):
    """A drafter dir whose config declares sliding-window layers, as z-lab's later drafters do."""
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=8, layers=2)
    save_draft(draft, tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    raw = json.loads(path.read_text())
    raw.update(layer_types=["sliding_attention", "full_attention"], sliding_window=5, use_sliding_window=True)
    raw.pop("block_size")
    raw["dflash_config"]["block_size"] = 8  # block size inside dflash_config (the 122B drafter's layout)
    if causal is not None:
        raw["is_causal"] = causal
    path.write_text(json.dumps(raw))
    return target, tmp_path / "d"


@pytest.mark.parametrize("causal", [None, False])
def test_sliding_window_draft_layers_agree_with_the_reference(tmp_path, causal):
    pytest.importorskip("dflash")
    from dflash.model import DFlashDraftModel

    target, path = _sliding_drafter(tmp_path, causal)
    draft = load_draft(path)
    assert draft.block_size == 8 and draft.cfg.layer_attention(0) == (causal is None, 5)
    assert draft.cfg.layer_attention(1) == (bool(causal), None) and not draft.cfg.plain_attention
    ref = DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32).eval()
    torch.manual_seed(0)
    ctx = 11
    taps = torch.randn(1, ctx, 3 * 64)
    emb = target.embed_tokens(torch.tensor([[5] + [draft.cfg.mask_token_id] * 7]))
    with torch.no_grad():
        ours = target.lm_head(draft(emb, torch.arange(ctx, ctx + 8), taps, torch.arange(ctx)))
        theirs = target.lm_head(ref(position_ids=torch.arange(ctx + 8)[None], noise_embedding=emb, target_hidden=taps))
        full = DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32, layer_types=None, sliding_window=None)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # the window is honoured: the same weights with full layers draft differently
    with torch.no_grad():
        plain = target.lm_head(full.eval()(position_ids=torch.arange(ctx + 8)[None], noise_embedding=emb, target_hidden=taps))
    assert not torch.allclose(plain, theirs, atol=1e-4)
    again = json.loads((save_draft(draft, tmp_path / "e") / "config.json").read_text())
    assert again["layer_types"] == ["sliding_attention", "full_attention"] and again["sliding_window"] == 5


def test_a_sliding_window_drafter_decodes_losslessly(tmp_path):
    from blockdraft.decoding.engine import Engine, GenerationConfig

    target, path = _sliding_drafter(tmp_path)
    cfg = GenerationConfig(max_new_tokens=40, stop_token_ids=(), lookup=False, block_size=8)
    prompt = list(range(3, 30))
    assert Engine(target, load_draft(path)).generate(prompt, cfg).token_ids == Engine(target).generate(prompt, cfg).token_ids


@pytest.mark.parametrize("change,words", [
    (dict(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel"),
    (dict(dflash_config=dict(mask_token_id=0, selector_rank=256)), "selector_rank"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
    (dict(layer_types=["full_attention"]), "layer_types must list 2"),
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types must list"),
])
def test_drafter_variants_it_cannot_run_are_refused(tmp_path, change, words):
    from blockdraft.errors import BlockdraftError

    target = tiny_target("llama")
    save_draft(tiny_draft(target, layers=2), tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    raw = {**json.loads(path.read_text()), **change}
    raw.pop("sliding_window", None) if "sliding_window" in words else None
    path.write_text(json.dumps(raw))
    with pytest.raises(BlockdraftError, match=words):
        load_draft(tmp_path / "d")


def test_training_refuses_to_start_from_a_sliding_window_drafter(tmp_path):
    from blockdraft.errors import BlockdraftError
    from blockdraft.training.warmstart import init_from_drafter

    target, path = _sliding_drafter(tmp_path)
    with pytest.raises(BlockdraftError, match="full bidirectional"):
        init_from_drafter(tiny_draft(target, block_size=8, layers=2), str(path), None)


@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0),  # Kimi-K2.5's kind
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32),
])
def test_scaled_rope_drafters_agree_with_the_reference(tmp_path, rope):
    """z-lab's Kimi-K2.5 drafter carries a YaRN RoPE; scaled RoPEs load and draft as the reference does."""
    pytest.importorskip("dflash")
    from dflash.model import DFlashDraftModel

    target = tiny_target("llama")
    save_draft(tiny_draft(target, block_size=8, layers=2), tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    raw = json.loads(path.read_text())
    raw["rope_parameters"] = {**rope, "rope_theta": raw["rope_theta"]}
    path.write_text(json.dumps(raw))
    draft = load_draft(tmp_path / "d")
    assert draft.cfg.rope_scaling["rope_type"] == rope["rope_type"]
    ref = DFlashDraftModel.from_pretrained(str(tmp_path / "d"), dtype=torch.float32).eval()
    torch.manual_seed(0)
    ctx = 40  # past the original context, where the scaling matters
    taps = torch.randn(1, ctx, 3 * 64)
    emb = target.embed_tokens(torch.tensor([[5] + [draft.cfg.mask_token_id] * 7]))
    with torch.no_grad():
        ours = target.lm_head(draft(emb, torch.arange(ctx, ctx + 8), taps, torch.arange(ctx)))
        theirs = target.lm_head(ref(position_ids=torch.arange(ctx + 8)[None], noise_embedding=emb, target_hidden=taps))
        plain = target.lm_head(load_draft_plain(tmp_path)(emb, torch.arange(ctx, ctx + 8), taps, torch.arange(ctx)))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(plain, ours, atol=1e-4)  # the scaling is applied, not ignored
    again = json.loads((save_draft(draft, tmp_path / "e") / "config.json").read_text())
    assert again["rope_parameters"]["rope_type"] == rope["rope_type"] and again["rope_parameters"]["factor"] == 8.0


def load_draft_plain(tmp_path):
    """The same weights with the default RoPE."""
    import shutil

    shutil.copytree(tmp_path / "d", tmp_path / "plain")
    path = tmp_path / "plain" / "config.json"
    raw = json.loads(path.read_text())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
    path.write_text(json.dumps(raw))
    return load_draft(tmp_path / "plain")


def test_unsupported_or_broken_rope_is_refused(tmp_path):
    from blockdraft.errors import BlockdraftError

    target = tiny_target("llama")
    save_draft(tiny_draft(target, layers=2), tmp_path / "d")
    path = tmp_path / "d" / "config.json"
    raw = json.loads(path.read_text())
    for rope, words in ((dict(rope_type="dynamic", factor=2.0), "not supported"), (dict(rope_type="yarn"), "bad yarn")):
        raw["rope_parameters"] = {**rope, "rope_theta": 10000.0}
        path.write_text(json.dumps(raw))
        with pytest.raises(BlockdraftError, match=words):
            load_draft(tmp_path / "d")
