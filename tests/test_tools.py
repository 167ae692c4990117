"""The commands around training and serving that were scripts once: `blockdraft export` (the
launch command of vLLM and SGLang for a drafter), `blockdraft accuracy` and `blockdraft plot-training`."""

import json
import shlex
import subprocess

import pytest
import torch

from blockdraft.cli import main
from blockdraft.models.checkpoint import save_draft
from blockdraft.serving.peers import launch_command
from conftest import tiny_draft, tiny_target


def _spec(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--speculative-config") + 1])


def test_export_prints_the_vllm_and_sglang_launch_commands(tmp_path, capsys):
    target = tiny_target()
    target.model.save_pretrained(tmp_path / "target")
    save_draft(tiny_draft(target, block_size=8), tmp_path / "draft")
    base = ["export", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]

    assert main(base + ["--format", "vllm", "--dtype", "float32", "--port", "8100"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str((tmp_path / "target").resolve())
    assert _spec(argv) == {"method": "dflash", "model": str((tmp_path / "draft").resolve()),
                           "num_speculative_tokens": 7}  # block 8: the anchor and 7 drafts
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--port") + 1] == "8100"
    assert "--enforce-eager" not in argv

    assert main(base + ["--format", "vllm", "--cpu", "--block-size", "4"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("VLLM_CPU_NUM_OF_RESERVED_CPU=0 ")
    argv = shlex.split(line)[1:]
    assert _spec(argv)["num_speculative_tokens"] == 3 and "--enforce-eager" in argv

    assert main(base + ["--format", "sglang"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert argv[argv.index("--speculative-algorithm") + 1] == "DFLASH"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "8"
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str((tmp_path / "draft").resolve())

    script = tmp_path / "serve.sh"
    assert main(base + ["--format", "vllm", "--python", "echo", "--out", str(script)]) == 0
    ran = subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout.split()
    assert ran[:2] == ["-m", "vllm.entrypoints.openai.api_server"]  # `echo` stands in for the peer's python


def test_export_refuses_a_missing_drafter_and_a_block_of_one(tmp_path, capsys):
    assert main(["export", "--format", "vllm", "--draft", str(tmp_path / "none")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    target = tiny_target()
    save_draft(tiny_draft(target), tmp_path / "draft")
    assert main(["export", "--format", "sglang", "--target", "some/hub-id", "--draft", str(tmp_path / "draft"),
                 "--block-size", "1"]) == 2
    assert "block size must be >= 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown format"):
        launch_command("tgi", "t", "d", 16)


def test_accuracy_scores_saved_drafters_on_a_held_out_split(tmp_path, capsys):
    target = tiny_target()
    target.model.save_pretrained(tmp_path / "target")
    gen = torch.Generator().manual_seed(0)
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "samples.jsonl", "w") as f:
        for i in range(4):
            ids = torch.randint(0, 90, (40,), generator=gen).tolist()
            f.write(json.dumps({"id": str(i), "split": "heldout" if i < 3 else "train", "input_ids": ids,
                                "loss_mask": [0] * 6 + [1] * 34}) + "\n")
    for seed in (1, 2):
        save_draft(tiny_draft(target, seed=seed), tmp_path / f"d{seed}")
    assert main(["accuracy", str(tmp_path / "data"), str(tmp_path / "d1"), str(tmp_path / "d2"),
                 "--target", str(tmp_path / "target"), "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all("acc@1 " in x and "(3 held-out sequences), held-out tau " in x for x in lines)
    assert all(float(x.rsplit(" ", 1)[1]) >= 1.0 for x in lines)  # tau counts the bonus token
    (tmp_path / "train-only").mkdir()
    with open(tmp_path / "train-only" / "samples.jsonl", "w") as f:
        f.write(json.dumps({"id": "0", "split": "train", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    assert main(["accuracy", str(tmp_path / "train-only"), str(tmp_path / "d1"), "--target",
                 str(tmp_path / "target")]) == 2


def test_plot_training_draws_stages_and_refuses_unreadable_logs(tmp_path, capsys):
    logs = []
    for stage in range(2):
        rows = [{"step": s, "samples_seen": 8 * s, "loss": 3.0 - s / 10} for s in range(1, 6)]
        rows += [{"step": s, "heldout_tau": 1.2 + stage / 10 + s / 50, "heldout_acc": [0.3, 0.1]} for s in (2, 5)]
        logs.append(tmp_path / f"stage{stage}.jsonl")
        logs[-1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = tmp_path / "tau.json"
    bench.write_text(json.dumps({"dataset": "humaneval", "prompts": 4, "drafters": {"a": {"tau": 1.5}, "b": {"tau": 1.7}}}))
    out = tmp_path / "curve.png"
    assert main(["plot-training", *map(str, logs), "--out", str(out), "--start", "1.1", "0.2",
                 "--bench", str(bench)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["plot-training", str(bad), "--out", str(tmp_path / "x.png")]) == 2
    assert main(["plot-training", str(logs[0]), "--out", str(tmp_path / "x.png"), "--bench", str(bench)]) == 2
    assert "2 drafters for 1 stages" in capsys.readouterr().err


def test_serve_with_the_vllm_backend_execs_vllms_server_with_the_export_command(tmp_path):
    import sys
    from pathlib import Path

    target = tiny_target()
    target.model.save_pretrained(tmp_path / "target")
    save_draft(tiny_draft(target, block_size=4), tmp_path / "draft")
    blockdraft = str(Path(sys.executable).parent / "blockdraft")
    base = [blockdraft, "serve", "--backend", "vllm", "--target", str(tmp_path / "target"), "--draft",
            str(tmp_path / "draft"), "--port", "8200", "--api-key", "k", "--device", "cpu"]
    ran = subprocess.run(base + ["--vllm-python", "echo"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    argv = ran.stdout.splitlines()[-1].split()  # what `echo` (standing in for vLLM's python) was given
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8200" and "--api-key" not in argv  # the key goes by VLLM_API_KEY
    assert " k" not in ran.stdout.splitlines()[0]  # nor into the printed command
    assert '"num_speculative_tokens":' in ran.stdout and "--enforce-eager" in argv  # --device cpu: the CPU build
    missing = subprocess.run(base + ["--vllm-python", str(tmp_path / "no-python")], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "cannot start vLLM" in missing.stderr
    no_draft = [a if a != str(tmp_path / "draft") else "none" for a in base]
    none = subprocess.run(no_draft + ["--vllm-python", "echo"], capture_output=True, text=True, timeout=120)
    assert none.returncode == 2 and "--draft none" in none.stderr


def test_export_reads_a_block_size_kept_in_dflash_config(tmp_path, capsys):
    """z-lab's later drafters keep block_size in dflash_config, not at the top of config.json."""
    target = tiny_target()
    save_draft(tiny_draft(target, block_size=8), tmp_path / "draft")
    path = tmp_path / "draft" / "config.json"
    raw = json.loads(path.read_text())
    raw["dflash_config"]["block_size"] = raw.pop("block_size")
    path.write_text(json.dumps(raw))
    assert main(["export", "--format", "vllm", "--target", "some/hub-id", "--draft", str(tmp_path / "draft")]) == 0
    assert _spec(shlex.split(capsys.readouterr().out.strip()))["num_speculative_tokens"] == 7
