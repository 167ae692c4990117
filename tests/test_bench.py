"""The benchmark harness itself (timings are benchmarks, not tests)."""

import json

import pytest

from blockdraft import bench
from blockdraft.benchdata import load_prompts
from blockdraft.errors import BlockdraftError

from conftest import tiny_draft, tiny_target


def test_datasets_load_offline(tmp_path):
    he = load_prompts("humaneval")
    assert len(he) == 164 and "def has_close_elements" in he[0] and he[0].startswith("Write a solution")
    mt = load_prompts("mt-bench")
    assert len(mt) == 80 and "Hawaii" in mt[0]
    assert len(load_prompts("mt-bench", limit=5)) == 5
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert load_prompts(str(f)) == ["a", "b"]
    with pytest.raises(BlockdraftError, match="unknown dataset"):
        load_prompts("nope")


def test_report_schema_and_identical_outputs():
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=4)
    report = bench.run_bench(target, draft, [[1, 2, 3], [4, 5]], max_new_tokens=12, progress=False,
                             oracle_keep=1.0)
    json.loads(bench.dump(report))
    assert report["mismatches"] == []
    assert report["methods"]["oracle"]["tau"] > 2
    assert report["methods"]["oracle"]["ceiling_speedup_vs_ar"] > 0
    costs = report["cost_model_seconds"]["target_forward_by_tokens"]
    assert sorted(costs) == [1, 2, 3, 4] and report["cost_model_seconds"]["draft_forward"] > 0
    for m in ("dflash", "ar", "hf", "oracle"):
        r = report["methods"][m]
        assert r["tokens"] == 24 and r["tok_s"] > 0 and "speedup_vs_hf" in r and "speedup_vs_ar" in r
        assert len(r["acceptance_histogram"]) == 4
    assert report["methods"]["ar"]["tau"] == 1.0
    assert "outputs identical" in bench.format_table(report)


def test_a_planted_difference_is_caught(monkeypatch):
    target = tiny_target("llama")
    real = bench._run_engine

    def corrupt(engine, ids, cfg, res):
        out = real(engine, ids, cfg, res)
        return out[:-1] + [(out[-1] + 1) % 96] if engine.draft is not None else out

    monkeypatch.setattr(bench, "_run_engine", corrupt)
    report = bench.run_bench(target, tiny_draft(target), [[1, 2, 3]], ("dflash", "ar", "hf"), max_new_tokens=8,
                             progress=False)
    assert report["mismatches"] == [{"method": "dflash", "prompt": 0}]
    assert "MISMATCH" in bench.format_table(report)


def test_peer_methods_and_oracle_sweep_give_identical_outputs_and_a_plot(tmp_path):
    target = tiny_target("llama")
    assistant = tiny_target("llama", seed=5, layers=2)  # same vocabulary, different model
    draft = tiny_draft(target, block_size=4)
    methods = ("dflash", "ar", "hf", "hf-pld", "hf-assisted", "oracle@0.5", "oracle@1")
    report = bench.run_bench(target, draft, [[1, 2, 3, 1, 2, 3], [4, 5]], methods, max_new_tokens=12,
                             progress=False, assistant=assistant)
    assert report["mismatches"] == []
    assert report["oracle_keep"] == {"oracle@0.5": 0.5, "oracle@1": 1.0}
    assert report["methods"]["oracle@1"]["tau"] > report["methods"]["oracle@0.5"]["tau"]
    assert report["methods"]["hf-pld"]["tau"] is None and report["methods"]["hf-pld"]["tokens"] == 24
    bench.plot_report({**report, "dataset": "tiny"}, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_method_lists_are_refused():
    for bad in (("nope",), ("oracle@2",), ("oracle@x",), ("ar", "ar"), ()):
        with pytest.raises(BlockdraftError):
            bench.check_methods(bad)
    target = tiny_target("llama")
    with pytest.raises(BlockdraftError, match="assistant"):
        bench.run_bench(target, None, [[1, 2]], ("hf-assisted",), max_new_tokens=4, progress=False)
