"""tau by replay must give the engine's own acceptance lengths, step for step."""

import json

import pytest
import torch

from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.decoding.oracle import OracleDraft
from blockdraft.evaluation.replay import reference_continuations, replay

from conftest import tiny_draft, tiny_target

PROMPTS = [[5, 17, 33, 2], [7] * 12, list(range(3, 40))]


def engine_lengths(target, draft, prompt, n, block_size, stop=()):
    cfg = GenerationConfig(max_new_tokens=n, block_size=block_size, stop_token_ids=stop, lookup=False)  # replay models the drafter
    out = Engine(target, draft).generate(prompt, cfg)
    return out.token_ids, out.stats.acceptance_lengths


@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_replay_equals_engine_random_drafter(target, block_size):
    draft = tiny_draft(target, block_size=8)
    for prompt in PROMPTS:
        tokens, lengths = engine_lengths(target, draft, prompt, 40, block_size)
        assert replay(target, draft, prompt, tokens, block_size, 40).acceptance_lengths == lengths


@pytest.mark.parametrize("keep", [0.5, 0.8, 1.0])
def test_replay_equals_engine_partial_acceptance(target, keep):
    """An oracle drafter gives long, varied acceptance; its random draws happen in call order,
    so the replay must make the same draft calls in the same order to agree."""
    plain = Engine(target)
    for prompt in PROMPTS:
        truth = plain.generate(prompt, GenerationConfig(max_new_tokens=50, stop_token_ids=())).token_ids
        base = tiny_draft(target, block_size=8)
        _, lengths = engine_lengths(target, OracleDraft(base, truth, len(prompt), keep, seed=4), prompt, 50, 8)
        got = replay(target, OracleDraft(base, truth, len(prompt), keep, seed=4), prompt, truth, 8, 50)
        assert got.acceptance_lengths == lengths
        assert sum(lengths) + 1 == len(truth)
        if keep == 1.0:
            assert got.tau > 5
        assert got.tau == pytest.approx(sum(lengths) / len(lengths))


def test_replay_at_a_stop_token():
    """The reference ends at EOS; the engine's last step is cut there, and so is the replay's."""
    target = tiny_target("llama")
    plain = Engine(target)
    free = plain.generate(PROMPTS[2], GenerationConfig(max_new_tokens=40, stop_token_ids=())).token_ids
    stop = (free[25],)
    truth = plain.generate(PROMPTS[2], GenerationConfig(max_new_tokens=40, stop_token_ids=stop)).token_ids
    assert truth[-1] == stop[0] and len(truth) < 40
    base = tiny_draft(target, block_size=8)
    _, lengths = engine_lengths(target, OracleDraft(base, truth, len(PROMPTS[2]), 1.0), PROMPTS[2], 40, 8, stop)
    got = replay(target, OracleDraft(base, truth, len(PROMPTS[2]), 1.0), PROMPTS[2], truth, 8, 40)
    assert got.acceptance_lengths == lengths and sum(lengths) + 1 == len(truth)


def test_references_are_plain_greedy_and_cached(tmp_path):
    target = tiny_target("qwen3")
    path = tmp_path / "refs.json"
    refs = reference_continuations(target, PROMPTS, 30, path, batch_size=2, progress=False)
    plain = Engine(target)
    for prompt, ref in zip(PROMPTS, refs):
        assert ref == plain.generate(prompt, GenerationConfig(max_new_tokens=30)).token_ids
    cached = json.loads(path.read_text())
    assert len(cached) == 3
    # a second call reads the file and generates nothing: planted values come back as they are
    key = next(iter(cached))
    cached[key] = [1, 2, 3]
    path.write_text(json.dumps(cached))
    again = reference_continuations(target, PROMPTS, 30, path, progress=False)
    assert [1, 2, 3] in again
    assert reference_continuations(target, PROMPTS, 31, path, progress=False)[0] != [1, 2, 3]


def test_references_batch_prompts_of_similar_length_and_keep_their_order(monkeypatch):
    """A batch is left-padded to its longest prompt, so the references are generated in batches
    of prompts sorted by length; they come back in the prompts' order, each plain greedy."""
    target = tiny_target("qwen3")
    prompts = [list(range(3, 40)), [5, 17, 33, 2], [7] * 12, [9, 8, 7, 6, 5]]
    groups, greedy_batch = [], target.greedy_batch

    def spy(group, n):
        groups.append([len(p) for p in group])
        return greedy_batch(group, n)

    monkeypatch.setattr(target, "greedy_batch", spy)
    refs = reference_continuations(target, prompts, 20, None, batch_size=2, progress=False)
    assert groups == [[4, 5], [12, 37]]
    plain = Engine(target)
    assert refs == [plain.generate(p, GenerationConfig(max_new_tokens=20)).token_ids for p in prompts]


def test_cli_tau_refuses_bad_input(capsys):
    from blockdraft.cli import main

    assert main(["tau", "--draft", "no/such/dir", "--limit", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["tau", "--block-size", "1", "--limit", "1"]) == 2
    assert "block-size" in capsys.readouterr().err


@pytest.mark.slow
def test_replay_equals_engine_on_smollm2_with_the_bundled_drafter():
    from blockdraft.models.checkpoint import load_draft
    from blockdraft.cli import bundled_drafter
    from blockdraft.models.target import load_target

    if bundled_drafter("smollm2-135m") is None:
        pytest.skip("no bundled drafter")
    torch.set_num_threads(2)
    target = load_target("smollm2-135m", device="cpu")
    draft = load_draft(bundled_drafter("smollm2-135m"))
    prompts = [target.encode_prompt(t, chat=True) for t in
               ["Write a Python function that checks whether a number is prime.", "Name three planets."]]
    refs = reference_continuations(target, prompts, 64, None, progress=False)
    for prompt, ref in zip(prompts, refs):
        tokens, lengths = engine_lengths(target, draft, prompt, 64, 16, tuple(target.stop_token_ids))
        assert tokens == ref
        assert replay(target, draft, prompt, ref, 16, 64).acceptance_lengths == lengths


@pytest.mark.slow
def test_cli_tau_reports_a_consistent_histogram(tmp_path, capsys):
    from blockdraft.cli import bundled_drafter, main

    if bundled_drafter("smollm2-135m") is None:
        pytest.skip("no bundled drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Write a Python function that adds two numbers."}\n')
    out = tmp_path / "tau.json"
    assert main(["tau", "--dataset", str(prompts), "--max-new-tokens", "40", "--block-size", "8",
                 "--references", str(tmp_path / "refs.json"), "--json", str(out), "--device", "cpu"]) == 0
    (d,) = json.loads(out.read_text())["drafters"].values()
    hist = d["acceptance_histogram"]
    assert len(hist) == 8 and sum(hist) == d["steps"]
    assert sum(k * c for k, c in enumerate(hist, 1)) == d["acceptance_lengths_total"] == 39  # the first is the prefill's
    assert abs(d["tau"] - 39 / d["steps"]) < 1e-3
    assert "steps by tokens committed" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_tau_replays_the_drafter_as_the_engine_runs_it(tmp_path):
    """`tau --draft-dtype int8`: the drafter with int8 weights computed in fp32, as the engine runs it
    (recorded in the report); the same prompt's tau stays close to the drafter as loaded."""
    from blockdraft.cli import bundled_drafter, main
    from blockdraft.ops import few_rows

    if bundled_drafter("smollm2-135m") is None or not few_rows.available():
        pytest.skip("no bundled drafter or no few-row kernel")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Write a Python function that adds two numbers."}\n')
    reports = {}
    for dtype in (None, "int8"):
        out = tmp_path / f"tau-{dtype}.json"
        argv = ["tau", "--dataset", str(prompts), "--max-new-tokens", "40", "--block-size", "8",
                "--references", str(tmp_path / "refs.json"), "--json", str(out), "--device", "cpu"]
        assert main(argv + (["--draft-dtype", dtype] if dtype else [])) == 0
        (reports[dtype],) = json.loads(out.read_text())["drafters"].values()
    assert reports[None]["draft_precision"] == "torch.float32"
    assert reports["int8"]["draft_precision"] == "torch.int8 weights, torch.float32 compute"
    assert reports["int8"]["acceptance_lengths_total"] == 39
    assert abs(reports["int8"]["tau"] - reports[None]["tau"]) < 0.5 * reports[None]["tau"]
