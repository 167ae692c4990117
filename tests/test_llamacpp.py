"""llama.cpp interop: `blockdraft export --format gguf` writes the drafter as llama.cpp's converter
does (arch dflash, block size, target layers + 1, mask token, the draft's tensors only) with the
target GGUF's own tokenizer, refuses what llama.cpp cannot run, and llama-server, built once by
`make llamacpp-env`, loads it: its greedy text with the drafter is its plain text
(scripts/check_llamacpp.py; docs/llamacpp.md)."""

import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from blockdraft.cli import main
from blockdraft.errors import BlockdraftError
from blockdraft.models.checkpoint import STUDY_ARCHITECTURE
from blockdraft.models.gguf_export import (GLOBAL_TENSORS, LAYER_TENSORS, MASK_TOKEN_KEY, export_drafter,
                                           read_target, write_f32_gguf)
from blockdraft.models.target import SMOLLM2_GGUF, cache_dir, resolve_target_path, smollm2_gguf_dir

gguf = pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parent.parent
DRAFTER = ROOT / "blockdraft" / "drafters" / "smollm2-135m"
TARGET_GGUF = smollm2_gguf_dir() / SMOLLM2_GGUF


@pytest.fixture(scope="module")
def target():
    return read_target(TARGET_GGUF)


def _fields(path):
    """(the reader, its fields by key)"""
    reader = gguf.GGUFReader(path)
    return reader, dict(reader.fields)


def test_the_gguf_carries_what_llamacpp_reads(target, tmp_path):
    written = export_drafter(DRAFTER, target, tmp_path / "d.gguf")
    cfg = json.loads((DRAFTER / "config.json").read_text())
    reader, f = _fields(written.path)
    value = lambda key: f[key].contents()  # noqa: E731
    assert value("general.architecture") == "dflash"
    assert value("dflash.block_size") == cfg["block_size"] == written.block_size == 16
    # llama.cpp's converter writes the tap layer ids + 1 (the embedding output is its layer 0), as int32
    taps = cfg["dflash_config"]["target_layer_ids"]
    assert value("dflash.target_layers") == [i + 1 for i in taps] == written.target_layers == [2, 9, 15, 21, 28]
    assert f["dflash.target_layers"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert value(MASK_TOKEN_KEY) == cfg["dflash_config"]["mask_token_id"] == 16
    assert {k: value(f"dflash.{k}") for k in ("block_count", "embedding_length", "feed_forward_length",
                                               "attention.head_count", "attention.head_count_kv",
                                               "attention.key_length", "attention.value_length",
                                               "context_length")} == {
        "block_count": 3, "embedding_length": 576, "feed_forward_length": 1536, "attention.head_count": 9,
        "attention.head_count_kv": 3, "attention.key_length": 64, "attention.value_length": 64,
        "context_length": 8192}
    assert value("dflash.rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert value("dflash.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
    # every tokenizer key of the target's own GGUF, unchanged
    _, tf = _fields(TARGET_GGUF)
    tok_keys = [k for k in tf if k.startswith("tokenizer.")]
    assert "tokenizer.ggml.tokens" in tok_keys and "tokenizer.ggml.merges" in tok_keys
    for k in tok_keys:
        assert f[k].types == tf[k].types and f[k].contents() == tf[k].contents(), k
    # the draft's tensors only: the target's embedding and head are shared (TENSOR_NOT_REQUIRED)
    names = set(GLOBAL_TENSORS.values()) | {f"blk.{i}.{n}" for i in range(3) for n in LAYER_TENSORS.values()}
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == names and "token_embd.weight" not in tensors and "output.weight" not in tensors
    assert [int(d) for d in tensors["fc.weight"].shape] == [5 * 576, 576]  # GGUF order: [in, out]
    assert [int(d) for d in tensors["blk.0.attn_k.weight"].shape] == [576, 192]
    assert [int(d) for d in tensors["blk.0.ffn_down.weight"].shape] == [1536, 576]
    # auto: matrices keep the checkpoint's f16, vectors are f32 (as the converter writes them)
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["enc.output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert value("general.file_type") == gguf.LlamaFileType.MOSTLY_F16


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_tensor_values_are_the_checkpoints(target, tmp_path, outtype):
    written = export_drafter(DRAFTER, target, tmp_path / "d.gguf", outtype)
    state = load_file(str(DRAFTER / "model.safetensors"))
    tensors = {t.name: t for t in gguf.GGUFReader(written.path).tensors}
    for name, gguf_name in [("fc.weight", "fc.weight"), ("layers.2.mlp.up_proj.weight", "blk.2.ffn_up.weight"),
                            ("norm.weight", "output_norm.weight")]:
        t = tensors[gguf_name]
        got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        want = state[name].float()
        if outtype == "bf16" and want.dim() == 2:
            want = want.bfloat16().float()
        np.testing.assert_array_equal(got.reshape(want.shape), want.numpy())


def test_f32_copy_of_a_quantized_gguf(tmp_path):
    src = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    rows = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader, f = _fields(write_f32_gguf(src, tmp_path / "f.gguf"))
    assert f["general.file_type"].contents() == 0 and f["llama.block_count"].contents() == 1
    assert f["tokenizer.ggml.tokens"].contents() == ["a", "b"]
    t = reader.tensors[0]
    assert t.tensor_type == gguf.GGMLQuantizationType.F32 and [int(d) for d in t.shape] == [64, 4]
    q = gguf.GGUFReader(src).tensors[0]
    np.testing.assert_array_equal(np.asarray(t.data), gguf.quants.dequantize(np.asarray(q.data), q.tensor_type))


def _drafter_copy(tmp_path, **changes) -> Path:
    d = tmp_path / "drafter"
    d.mkdir()
    os.symlink(DRAFTER / "model.safetensors", d / "model.safetensors")
    cfg = json.loads((DRAFTER / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_refusals(target, tmp_path):
    ablated = _drafter_copy(tmp_path, architectures=[STUDY_ARCHITECTURE], blockdraft_conditioning="input")
    with pytest.raises(BlockdraftError, match="ablate"):
        export_drafter(ablated, target, tmp_path / "x.gguf")
    with pytest.raises(BlockdraftError, match="not a drafter"):
        export_drafter(tmp_path, target, tmp_path / "x.gguf")
    small = tmp_path / "small.gguf"  # a target GGUF whose vocabulary is not the drafter's
    w = gguf.GGUFWriter(str(small), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(100)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(BlockdraftError, match="vocab_size 49152 but the target GGUF .* has 100 tokens"):
        export_drafter(DRAFTER, read_target(small), tmp_path / "x.gguf")
    with pytest.raises(BlockdraftError, match="not a readable GGUF"):
        read_target(DRAFTER / "config.json")
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".x.gguf*"))


def test_cli(tmp_path, capsys):
    out = tmp_path / "draft.gguf"
    assert main(["export", "--format", "gguf", "--out", str(out), "--outtype", "f16"]) == 0
    printed = capsys.readouterr().out
    assert "--spec-type draft-dflash --spec-draft-n-max 15" in printed and f"-md {out}" in printed
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "dflash"
    for argv, message in [([], "pass --out FILE.gguf"),
                          (["--out", str(out), "--draft", "none"], "--draft none"),
                          (["--out", str(out), "--target", str(tmp_path), "--draft", str(DRAFTER)],
                           "pass --target-gguf FILE"),
                          (["--out", str(out), "--block-size", "8"], "--spec-draft-n-max")]:
        assert main(["export", "--format", "gguf", *argv]) == 2
        assert message in capsys.readouterr().err
    assert main(["export", "--format", "vllm", "--outtype", "f32"]) == 2
    assert "for --format gguf" in capsys.readouterr().err


def test_the_cached_target_names_its_architectures():
    """llama.cpp's converter (and vLLM) read `architectures`; a cache written before it was named
    gets it on the next load, once."""
    config = resolve_target_path("smollm2-135m") / "config.json"
    before = config.read_text()
    assert json.loads(before)["architectures"] == ["LlamaForCausalLM"]
    resolve_target_path("smollm2-135m")
    assert config.read_text() == before


def llamacpp_dir() -> Path:
    """Where `make llamacpp-env` caches the build, at the Makefile's LLAMACPP_VERSION."""
    m = re.search(r"^LLAMACPP_VERSION \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    return cache_dir() / f"llama.cpp-{m.group(1) if m else '11434.0.0'}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_llama_server_runs_the_exported_drafter_with_its_plain_text(tmp_path):
    binary = llamacpp_dir() / "bin" / "llama-server"
    if not os.access(binary, os.X_OK):
        if not os.environ.get("BLOCKDRAFT_REQUIRE_LLAMACPP"):
            pytest.skip(f"no llama-server at {binary} (`make llamacpp-env` builds it; "
                        "BLOCKDRAFT_REQUIRE_LLAMACPP=1 makes its absence a failure)")
        pytest.fail(f"BLOCKDRAFT_REQUIRE_LLAMACPP is set but there is no llama-server at {binary}")
    spec = importlib.util.spec_from_file_location("check_llamacpp", ROOT / "scripts" / "check_llamacpp.py")
    check = importlib.util.module_from_spec(spec)
    sys.modules["check_llamacpp"] = check
    spec.loader.exec_module(check)

    from blockdraft.models.target import load_target

    tok = load_target("smollm2-135m", device="cpu")
    prompts = [tok.encode_prompt(t, True) for t in ("Write a Python function that reverses a string.",
                                                    "Name three colours of the rainbow.")]
    target = write_f32_gguf(TARGET_GGUF, tmp_path / "target-f32.gguf")
    out = tmp_path / "draft.gguf"  # through the CLI, as a user writes it
    assert main(["export", "--format", "gguf", "--out", str(out), "--outtype", "f32"]) == 0
    with check.LlamaServer(binary, target, tmp_path / "plain.log") as server:
        plain = [server.complete(ids, 32) for ids in prompts]
    with check.LlamaServer(binary, target, tmp_path / "dflash.log", out) as server:
        spec_out = [server.complete(ids, 32) for ids in prompts]
    log = (tmp_path / "dflash.log").read_text()
    assert "adding speculative implementation 'draft-dflash'" in log
    assert "block_size=16, mask_token_id=16, n_extract=5" in log
    for p, s in zip(plain, spec_out):
        assert p.token_ids
        assert s.token_ids == p.token_ids and s.text == p.text
        # the drafter really ran: drafts proposed, some accepted, the log's steps summing to the totals
        assert s.timings["draft_n"] > 0 and s.accepted_per_step
        assert sum(s.accepted_per_step) == s.timings["draft_n_accepted"] > 0
    # ... and drafted as ours does (wrong taps or a wrong mask token would collapse its acceptance):
    # per position, within the check's counting noise (scripts/check_llamacpp.py)
    ours = check.our_side(prompts, 32)
    for a, b in zip(check.total_per_position(ours), check.total_per_position(spec_out)):
        assert check.close(a, b), (check.total_per_position(ours), check.total_per_position(spec_out))
    shutil.rmtree(tmp_path, ignore_errors=True)  # the F32 target is 540 MB
