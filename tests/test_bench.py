"""The benchmark harness itself (timings are benchmarks, not tests)."""

import json

import pytest
import torch

from blockdraft.decoding.engine import Engine
from blockdraft.evaluation import bench, methods
from blockdraft.ops import few_rows
from blockdraft.evaluation.datasets import load_prompts
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
    # a fixed block: the adaptive policy's choices depend on timings, so its tau is not a test's
    report = bench.run_bench(target, draft, [[1, 2, 3], [4, 5]], max_new_tokens=12, block_size=4, progress=False,
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
        assert ("decode_speedup_vs_ar" in r) == (m != "hf")  # transformers gives no decode time
    assert report["methods"]["ar"]["tau"] == 1.0
    table = bench.format_table(report)
    assert "outputs identical to hf's" in table
    for m in ("dflash", "ar", "oracle"):  # our engine's decode time, by phase, sums to the decode time
        ms = report["methods"][m]["step_ms"]
        assert set(ms) == {"lookup", "draft", "target", "verify", "commit"} and ms["target"] > 0
        steps = sum(report["methods"][m]["acceptance_histogram"])
        decode = report["methods"][m]["tokens"] / report["methods"][m]["tok_s"]
        assert sum(ms.values()) * steps / 1e3 <= decode
    assert report["methods"]["ar"]["step_ms"]["draft"] < 0.05  # no draft forward: bookkeeping only (ms)
    assert "step_ms" not in report["methods"]["hf"]
    prof = report["step_profile_ms"]
    assert sorted(prof["target_body"]) == [1, 2, 4, 8, 16] and sorted(prof["draft_layers"]) == [2, 4, 8, 16]
    assert all(v > 0 for part in ("target_body", "target_head", "draft_layers") for v in prof[part].values())
    assert "step profile" in table and "ms per decode step by phase" in table


def test_a_planted_difference_is_caught(monkeypatch):
    target = tiny_target("llama")
    real = bench._run_engine

    def corrupt(engine, ids, cfg, res):
        out = real(engine, ids, cfg, res)
        return out[:-1] + [(out[-1] + 1) % 96] if engine.draft is not None else out

    monkeypatch.setattr(bench, "_run_engine", corrupt)
    report = bench.run_bench(target, tiny_draft(target), [[1, 2, 3]], ("dflash", "ar", "hf"), max_new_tokens=8,
                             progress=False)
    assert report["mismatches"] == [{"method": "dflash", "prompt": 0, "against": "hf"}]
    assert "MISMATCH" in bench.format_table(report)
    report = bench.run_bench(target, tiny_draft(target), [[1, 2, 3]], ("dflash", "ar"), max_new_tokens=8,
                             progress=False)
    assert report["mismatches"] == [{"method": "dflash", "prompt": 0, "against": "ar"}]
    report = bench.run_bench(target, tiny_draft(target), [[1, 2, 3]], ("dflash",), max_new_tokens=8, progress=False)
    assert report["compared_against"] is None and "not compared" in bench.format_table(report)


def test_peer_methods_and_oracle_sweep_give_identical_outputs_and_a_plot(tmp_path):
    target = tiny_target("llama")
    assistant = tiny_target("llama", seed=5, layers=2)  # same vocabulary, different model
    draft = tiny_draft(target, block_size=4)
    methods = ("dflash", "ar", "hf", "hf-pld", "hf-assisted", "oracle@0.5", "oracle@1", "dflash-lookup", "ar+lookup")
    report = bench.run_bench(target, draft, [[1, 2, 3, 1, 2, 3], [4, 5]], methods, max_new_tokens=12,
                             progress=False, assistant=assistant)
    assert report["mismatches"] == []
    assert report["oracle_keep"] == {"oracle@0.5": 0.5, "oracle@1": 1.0}
    assert report["methods"]["oracle@1"]["tau"] > report["methods"]["oracle@0.5"]["tau"]
    assert report["methods"]["hf-pld"]["tau"] is None and report["methods"]["hf-pld"]["tokens"] == 24
    assert report["methods"]["ar+lookup"]["lookup_steps"] > 0  # the repeated prompt gives lookups
    assert len(report["methods"]["ar+lookup"]["acceptance_histogram"]) == 11
    from blockdraft.evaluation.plot import plot_report

    plot_report({**report, "dataset": "tiny"}, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_method_lists_are_refused():
    for bad in (("nope",), ("oracle@2",), ("oracle@x",), ("ar", "ar"), (), ("ar:4",), ("hf-pld:8",),
                ("dflash@0.5",), ("oracle:0",), ("oracle@0.9:x",),
                ("hf+lookup",), ("oracle+lookup",), ("oracle-lookup",), ("ar-lookup+lookup",)):
        with pytest.raises(BlockdraftError):
            methods.check_methods(bad)
    target = tiny_target("llama")
    with pytest.raises(BlockdraftError, match="assistant"):
        bench.run_bench(target, None, [[1, 2]], ("hf-assisted",), max_new_tokens=4, progress=False)


def test_method_specs_parse():
    assert methods.parse_method("oracle@0.9:16") == methods.MethodSpec("oracle", 0.9, 16)
    assert methods.parse_method("oracle", 0.7) == methods.MethodSpec("oracle", 0.7, None)
    assert methods.parse_method("dflash:8") == methods.MethodSpec("dflash", None, 8, lookup=True)  # as it ships
    assert methods.parse_method("dflash-lookup:8") == methods.MethodSpec("dflash", None, 8, lookup=False)
    assert methods.parse_method("dflash+lookup") == methods.parse_method("dflash")
    assert methods.parse_method("hf-pld") == methods.MethodSpec("hf-pld")
    assert methods.parse_method("ar") == methods.MethodSpec("ar", lookup=False)  # plain decoding
    assert methods.parse_method("ar+lookup") == methods.MethodSpec("ar", lookup=True)
    assert methods.parse_method("dflash-lookup+tree16:16") == methods.MethodSpec("dflash", None, 16, False, 16)
    assert methods.parse_method("oracle@0.5+tree8") == methods.MethodSpec("oracle", 0.5, None, False, 8)
    assert methods.parse_method("dflash+tree").tree_budget == methods.TREE_BUDGET
    for bad in ("dflash+tree0", "dflash+treex", "ar+tree8"):
        with pytest.raises(BlockdraftError, match="tree"):
            methods.parse_method(bad)
    assert methods.parse_method("dflash-lookup+tree16:4/int8") == methods.MethodSpec("dflash", None, 4, False, 16, "int8")
    for bad in ("ar/int8", "dflash/auto", "dflash/fp8", "hf/float32"):
        with pytest.raises(BlockdraftError, match="dtype"):
            methods.parse_method(bad)


@pytest.mark.skipif(not few_rows.runs_on(torch.device("cpu"), torch.float32), reason="int8 weights need the few-row kernel")
def test_a_method_with_its_own_drafter_dtype_leaves_the_callers_drafter_as_it_was():
    """`dflash/int8` runs a copy of the drafter with int8 weights beside `dflash` with the caller's
    fp32 one; both keep plain decoding's greedy output, and the caller's drafter is not repacked."""
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=4)
    Engine(target, draft)  # set up in fp32, as a caller does
    report = bench.run_bench(target, draft, [[1, 2, 3], [4, 5]], ("dflash", "dflash/int8", "ar"), max_new_tokens=12,
                             block_size=4, progress=False)
    assert report["mismatches"] == []
    assert report["methods"]["dflash/int8"]["draft_precision"] == "torch.int8 weights, torch.float32 compute"
    assert draft.weight_storage is None and draft.precision == "torch.float32"
    assert report["draft_precision"] == "torch.float32"


def test_a_method_block_size_and_given_references():
    """`oracle@1:3` runs at block 3 while `dflash` keeps the run's block; the oracle takes the given
    greedy continuations instead of computing them, and a wrong one only costs acceptance."""
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=4)
    prompts = [[1, 2, 3], [4, 5]]
    refs = bench.run_bench(target, None, prompts, ("ar",), max_new_tokens=12, progress=False)
    from blockdraft.decoding.engine import Engine, GenerationConfig

    truth = [Engine(target).generate(p, GenerationConfig(max_new_tokens=12)).token_ids for p in prompts]
    report = bench.run_bench(target, draft, prompts, ("dflash", "hf", "oracle@1:3", "oracle@1"), max_new_tokens=12,
                             block_size=4, progress=False, references=truth)
    assert report["mismatches"] == []
    m = report["methods"]
    assert len(m["oracle@1:3"]["acceptance_histogram"]) == 3 and 2 < m["oracle@1:3"]["tau"] <= 3
    assert len(m["oracle@1"]["acceptance_histogram"]) == 4 and m["oracle@1"]["tau"] > 3
    assert m["oracle@1:3"]["block_size"] == 3 and m["dflash"]["block_size"] == 4
    assert sorted(report["cost_model_seconds"]["target_forward_by_tokens"]) == [1, 2, 3, 4]
    wrong = [[(t + 1) % 96 for t in r] for r in truth]
    report = bench.run_bench(target, draft, prompts, ("hf", "oracle@1"), max_new_tokens=12, block_size=4,
                             progress=False, references=wrong)
    assert report["mismatches"] == [] and report["methods"]["oracle@1"]["tau"] < 2
    with pytest.raises(BlockdraftError, match="references"):
        bench.run_bench(target, draft, prompts, ("oracle",), max_new_tokens=4, progress=False, references=truth[:1])
    assert refs["methods"]["ar"]["tokens"] == 24


def test_tree_methods_report_their_trees_and_the_ceiling_at_their_verify_size(tmp_path):
    """A tree of 6 nodes beside a chain of block 4: both lossless; the tree's report says how many
    steps verified a tree, their size and shape, and its ceiling reads the cost of 6 tokens."""
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    report = bench.run_bench(target, draft, prompts, ("oracle@0.7:4", "oracle@0.7+tree6:4", "ar"), max_new_tokens=16,
                             progress=False, profile=False)
    assert report["mismatches"] == []
    tree, chain = report["methods"]["oracle@0.7+tree6:4"], report["methods"]["oracle@0.7:4"]
    t = tree["trees"]
    assert t["steps"] == t["of_steps"] > 0 and t["mean_nodes"] <= 6 and t["nodes_by_depth"][0] == 1
    assert len(t["nodes_by_depth"]) <= 4 and tree["tree_budget"] == 6
    assert 0 < tree["accepted_per_verified"] <= 1 and "trees" not in chain
    assert sorted(report["cost_model_seconds"]["target_forward_by_tokens"]) == list(range(1, 7))
    assert "trees on" in bench.format_table(report)
    from blockdraft.evaluation.plot import plot_report, verify_sizes

    report["methods"]["oracle@0.7+tree3:4"] = {**tree, "tree_budget": 3}  # a third size: the panel is drawn
    assert verify_sizes(report) == {"chain": [(4, "oracle@0.7:4")],
                                    "tree": [(3, "oracle@0.7+tree3:4"), (6, "oracle@0.7+tree6:4")]}
    plot_report({**report, "dataset": "tiny"}, str(tmp_path / "trees.png"))
    assert (tmp_path / "trees.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_profile_runs_a_bf16_drafter_with_a_vocabulary_subset():
    """The drafter may compute in bf16 beside an fp32 target (`--draft-dtype auto` on a CPU with
    AVX512-BF16): the profile must feed each part in its own dtype, the subset head included."""
    from blockdraft.lab.profiling import profile_step

    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=4)
    draft.vocab_ids = torch.arange(0, target.vocab_size, 2)
    draft.to(dtype=torch.bfloat16)
    prof = profile_step(target, draft, [1, 2, 3, 4, 5], blocks=(1, 2, 4), repeats=1)
    assert sorted(prof["draft_head"]) == [2, 4] and all(v > 0 for v in prof["draft_head"].values())


FAKE_VLLM = '''
import os
from types import SimpleNamespace as NS

class SamplingParams:
    def __init__(self, temperature, max_tokens):
        self.max_tokens = max_tokens

class LLM:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("no engine for you")
        self.spec = (kwargs.get("speculative_config") or {}).get("num_speculative_tokens", 0)
        self.drafts = self.accepted = 0

    def generate(self, prompts, params, use_tqdm=False):
        if self.spec and params.max_tokens > 1:
            self.drafts += 4
            self.accepted += 2  # tau 1.5
        return [NS(outputs=[NS(token_ids=[7] * params.max_tokens)])]

    def get_metrics(self):
        return [NS(name="vllm:spec_decode_num_drafts", value=self.drafts),
                NS(name="vllm:spec_decode_num_accepted_tokens", value=self.accepted)]
'''


def _fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return prompt_token_ids\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))


def test_vllm_peer_rows_join_the_table_and_their_outputs_are_checked(tmp_path, monkeypatch):
    """The peer protocol end to end against a stand-in for vLLM (the real one: tests/test_vllm.py):
    one child per method, vLLM's counters give tau, and a peer whose tokens differ is caught."""
    import sys

    from blockdraft.lab.peer_vllm import VllmPeer

    _fake_vllm(tmp_path, monkeypatch)
    target = tiny_target("llama")
    peer = VllmPeer.start(sys.executable, tmp_path, tmp_path, {"vllm": 0, "vllm-dflash:4": 3}, "float32", 64,
                          tmp_path / "vllm.log")
    try:
        report = bench.run_bench(target, None, [[1, 2, 3], [4, 5]], ("ar", "vllm", "vllm-dflash:4"),
                                 max_new_tokens=6, progress=False, profile=False,
                                 peer=dict.fromkeys(("vllm", "vllm-dflash:4"), peer))
    finally:
        peer.close()
    assert all(c.proc.poll() is not None for c in peer.children.values())  # closed
    m = report["methods"]
    assert m["vllm"]["tau"] == 1.0 and m["vllm-dflash:4"]["tau"] == 1.5
    assert m["vllm-dflash:4"]["accepted_per_verified"] == round(2 / (4 * 3), 3)
    assert m["vllm"]["tokens"] == 12 and "speedup_vs_ar" in m["vllm"]  # (a stand-in takes no time to time)
    assert {x["method"] for x in report["mismatches"]} == {"vllm", "vllm-dflash:4"}  # [7, 7, ...] is not ar's
    assert "vllm-dflash:4" in bench.format_table(report)


def test_vllm_peer_errors_are_clear(tmp_path, monkeypatch):
    import sys

    from blockdraft.lab.peer_vllm import VllmPeer

    target = tiny_target("llama")
    with pytest.raises(BlockdraftError, match="make vllm-env"):
        VllmPeer.start(tmp_path / "no-python", tmp_path, tmp_path, {"vllm": 0}, "float32", 64, tmp_path / "l.log")
    with pytest.raises(BlockdraftError, match="needs a drafter"):
        VllmPeer.start(sys.executable, tmp_path, None, {"vllm-dflash": 15}, "float32", 64, tmp_path / "l.log")
    with pytest.raises(BlockdraftError, match="started vLLM peer"):
        bench.run_bench(target, None, [[1, 2]], ("ar", "vllm"), max_new_tokens=2, progress=False, profile=False)
    _fake_vllm(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(BlockdraftError, match="(?s)exited with 1 during start.*no engine for you"):
        VllmPeer.start(sys.executable, tmp_path, tmp_path, {"vllm": 0}, "float32", 64, tmp_path / "l.log")


def test_an_interrupted_bench_resumes_from_its_journal(tmp_path, monkeypatch):
    target = tiny_target("llama")
    draft = tiny_draft(target, block_size=4)
    prompts, path = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], tmp_path / "bench.jsonl"
    args = dict(methods=("dflash-lookup", "ar"), max_new_tokens=10, block_size=4, progress=False, profile=False,
                warmup=0, journal=path)
    full = bench.run_bench(target, draft, prompts, **{**args, "journal": None})
    real, calls = bench._run_engine, []

    def killed_at_the_third_prompt(engine, ids, cfg, res):
        calls.append(ids)
        if ids == prompts[2]:
            raise KeyboardInterrupt
        return real(engine, ids, cfg, res)

    monkeypatch.setattr(bench, "_run_engine", killed_at_the_third_prompt)
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(target, draft, prompts, **args)
    assert len(path.read_text().splitlines()) == 3  # the configuration, then two prompts
    with path.open("a") as f:
        f.write('{"prompt": 2, "meth')  # a line the kill cut short: dropped, its prompt run again
    calls.clear()
    monkeypatch.setattr(bench, "_run_engine", lambda *a: calls.append(a[1]) or real(*a))
    resumed = bench.run_bench(target, draft, prompts, **args)
    assert calls == [prompts[2], prompts[2]]  # the third prompt alone, once per method
    assert resumed["resumed_prompts"] == 2 and resumed["mismatches"] == []
    for m in ("dflash-lookup", "ar"):  # fixed blocks, greedy: the same steps as an uninterrupted run
        r, f = resumed["methods"][m], full["methods"][m]
        assert r["tokens"] == f["tokens"] == 30 and r["acceptance_histogram"] == f["acceptance_histogram"]
        assert r["tau"] == f["tau"]
    assert resumed["cost_model_seconds"]["prompts_measured"] == 3
    calls.clear()
    again = bench.run_bench(target, draft, prompts, **args)  # all journaled: nothing runs, same figures
    assert calls == [] and again["methods"]["ar"]["tokens"] == 30 and again["resumed_prompts"] == 3
    with pytest.raises(BlockdraftError, match="other settings \\(max_new_tokens\\)"):
        bench.run_bench(target, draft, prompts, **{**args, "max_new_tokens": 11})
    with pytest.raises(BlockdraftError, match="other settings \\(prompts\\)"):
        bench.run_bench(target, draft, prompts[:2], **args)
    (tmp_path / "other.jsonl").write_text("not json\n")
    with pytest.raises(BlockdraftError, match="not a bench journal"):
        bench.run_bench(target, draft, prompts, **{**args, "journal": tmp_path / "other.jsonl"})
