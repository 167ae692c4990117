"""Bad input is refused before any work, with one clear message naming the offending values."""

import json

import pytest

from blockdraft.models.checkpoint import check_fits, load_draft, save_draft
from blockdraft.cli import main, read_prompts
from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.models.draft import build_draft_config
from blockdraft.errors import BlockdraftError
from blockdraft.decoding.verify import SamplingParams

from conftest import tiny_draft, tiny_target


@pytest.fixture(scope="module")
def tgt():
    return tiny_target("llama")


def _cfg(tgt, **over):
    base = dict(num_layers=1, block_size=8, mask_token_id=3, num_taps=3)
    cfg = build_draft_config(tgt.config, **{k: v for k, v in over.items() if k in base} | {
        k: v for k, v in base.items() if k not in over})
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("field,value,words", [
    ("hidden_size", 128, "hidden_size 128"),
    ("vocab_size", 50, "vocab_size 50"),
    ("target_layer_ids", [1, 2, 9], "[9] outside the target's 6 layers"),
    ("block_size", 1, "block_size 1 < 2"),
    ("mask_token_id", 500, "mask_token_id 500"),
])
def test_drafter_that_does_not_fit(tgt, field, value, words):
    with pytest.raises(BlockdraftError, match=words.replace("[", r"\[").replace("]", r"\]")):
        check_fits(_cfg(tgt, **{field: value}), tgt)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(BlockdraftError, match="has no config.json"):
        load_draft(tmp_path)


def test_corrupt_weights(tmp_path, tgt):
    save_draft(tiny_draft(tgt), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(BlockdraftError, match="not a readable safetensors"):
        load_draft(tmp_path)


def test_corrupt_config(tmp_path, tgt):
    save_draft(tiny_draft(tgt), tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BlockdraftError, match="invalid JSON"):
        load_draft(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(BlockdraftError, match="missing"):
        load_draft(tmp_path)


def test_weights_that_do_not_match_the_config(tmp_path, tgt):
    save_draft(tiny_draft(tgt, layers=2), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    cfg["layer_types"] = ["full_attention"] * 3  # a consistent config, weights of 2 layers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BlockdraftError, match="missing"):
        load_draft(tmp_path)


def test_block_size_below_two_in_config(tmp_path, tgt):
    save_draft(tiny_draft(tgt), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["block_size"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BlockdraftError, match="block_size must be >= 2"):
        load_draft(tmp_path)


def test_prompt_longer_than_context(tgt):
    with pytest.raises(BlockdraftError, match="300 tokens; the target's context is 256"):
        Engine(tgt).generate([1] * 300, GenerationConfig(max_new_tokens=4))


@pytest.mark.parametrize("params,words", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e9), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(seed=-1), "seed"),
])
def test_bad_sampling_parameters(tgt, params, words):
    with pytest.raises(BlockdraftError, match=words):
        Engine(tgt).generate([1, 2], GenerationConfig(max_new_tokens=4, sampling=SamplingParams(**params)))


@pytest.mark.parametrize("n", [0, -5, 10**9])
def test_bad_max_new_tokens(tgt, n):
    with pytest.raises(BlockdraftError, match="max_new_tokens"):
        Engine(tgt).generate([1, 2], GenerationConfig(max_new_tokens=n))


def test_empty_prompt_and_bad_ids(tgt):
    with pytest.raises(BlockdraftError, match="empty"):
        Engine(tgt).generate([], GenerationConfig(max_new_tokens=4))
    with pytest.raises(BlockdraftError, match="outside the vocabulary"):
        Engine(tgt).generate([1, 10_000], GenerationConfig(max_new_tokens=4))


def test_prompts_file_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"prompt": 3}\n')
    with pytest.raises(BlockdraftError, match="p.jsonl:2"):
        read_prompts(None, str(f))
    with pytest.raises(BlockdraftError, match="exactly one"):
        read_prompts("a", str(f))


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    rc = main(["generate", "--target", str(tmp_path / "nope"), "--draft", "none", "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "error:" in err and "Traceback" not in err
    rc = main(["generate", "--draft", str(tmp_path / "missing"), "--prompt", "x"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    rc = main(["generate", "--draft", "none", "--prompt", "x", "--temperature", "-2"])
    assert rc == 2 and "temperature" in capsys.readouterr().err
