"""Every command in the README works as written: the tour's commands run here, in order, in a
fresh directory (the training ones build on each other), the Python snippet runs against
`blockdraft serve`, and the headline figures' commands (too long for a test: their figures are in
docs/ with the same commands) at least parse. A README command this file does not know fails the
test, so the README cannot drift from what is tested."""

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from blockdraft.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent

# run elsewhere: interactive or long-lived, each with the test that drives it
ELSEWHERE = {
    "blockdraft chat": "tests/test_chat.py (through a pseudo-terminal)",
    "blockdraft serve --port 8000": "this file, with the Python snippet (on a free port)",
}
# the headline figures: their commands and results are in docs/ (performance, serving, bundled drafter, vllm)
HEADLINE = {
    "blockdraft bench --dataset humaneval --limit 40 --max-new-tokens 256 --methods dflash,dflash+tree16,dflash-lookup,dflash-lookup+tree16,ar,hf",
    "blockdraft bench --dataset mt-bench --limit 80 --max-new-tokens 256 --methods dflash,dflash+tree16,dflash-lookup,dflash-lookup+tree16,ar,hf",
    "blockdraft bench --dataset humaneval --limit 40 --max-new-tokens 256 --methods dflash,dflash-lookup,dflash-lookup:4,dflash-lookup+tree16,ar,hf,hf-pld,vllm,vllm-dflash:4",
    "blockdraft bench --dataset mt-bench --limit 80 --max-new-tokens 256 --methods dflash,dflash-lookup,ar,hf,hf-pld,vllm,vllm-dflash:4",
    "blockdraft bench-serve --dataset mt-bench --limit 32 --concurrency 1,2,4,8,16 --max-batch 1,16 --max-new-tokens 128",
    "blockdraft tau --dataset humaneval --limit 40 --block-size 16",
    "blockdraft bench --dataset humaneval --limit 40 --max-new-tokens 256 --methods dflash+tree16,dflash,ar,hf,llamacpp,llamacpp-dflash:4",
    "blockdraft bench --dataset mt-bench --limit 80 --max-new-tokens 256 --methods dflash+tree16,dflash,ar,llamacpp,llamacpp-dflash:4,dflash+tree16+q8,ar+q8",
    "blockdraft bench --dataset humaneval --limit 40 --max-new-tokens 256 --methods dflash+tree16+q8,ar+q8,dflash+tree16,ar,llamacpp",
    "blockdraft bench --dataset mt-bench --limit 80 --max-new-tokens 256 --methods dflash+tree16,dflash,ar,hf,llamacpp,llamacpp-dflash:4",
}


def _blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of each fenced code block, in order."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                blocks.append((lang, lines))
                lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, "an unclosed code block"
    return blocks


def _code_commands() -> list[str]:
    """`blockdraft ...` lines of the README's shell blocks, in order."""
    return [line.strip() for lang, lines in _blocks(README) if lang == "" for line in lines
            if line.strip().startswith("blockdraft ")]


def _table_commands() -> list[str]:
    return re.findall(r"`(blockdraft [^`]+)`", README.split("## Install and quick start")[0])


def _tour() -> list[str]:
    return [c for c in _code_commands() if c not in ELSEWHERE]


def test_every_readme_command_is_known_and_parses():
    tour = _tour()
    for verb in ("generate", "tau", "bench", "bench-serve", "data", "train", "export"):
        assert any(c.startswith(f"blockdraft {verb} ") for c in tour), verb
    assert set(_table_commands()) - {"blockdraft export --format vllm", "blockdraft export --format gguf"} <= \
        HEADLINE | {"make check-vllm"}
    assert HEADLINE <= set(_table_commands())
    for cmd in _code_commands() + sorted(HEADLINE):
        argv = shlex.split(cmd)[1:]
        build_parser().parse_args(argv)  # exits (SystemExit) on a bad option
    docs = re.sub(r"\\\n\s*", "", "".join(p.read_text() for p in (ROOT / "docs").glob("*.md")))
    for cmd in HEADLINE:  # each headline figure's command is in docs/ beside its figure
        assert cmd in docs, cmd
    assert set(ELSEWHERE) <= set(_code_commands())
    assert "make demo" in README and "make test" in README and "make check-vllm" in README
    assert len(README.splitlines()) < 250


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_readme_tour_runs_as_written(tmp_path):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    for cmd in _tour():
        proc = subprocess.run(shlex.split(cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{cmd}\n{proc.stderr[-3000:]}"
        if cmd.startswith("blockdraft generate"):
            assert proc.stdout.strip() and " tok/s decode" in proc.stderr, cmd
        if cmd.startswith("blockdraft export"):
            assert '"method": "dflash"' in proc.stdout and '"num_speculative_tokens": 7' in proc.stdout
    assert (tmp_path / "runs" / "my-drafter" / "drafter" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_python_snippet_runs_against_blockdraft_serve(tmp_path):
    snippet = "\n".join(next(lines for lang, lines in _blocks(README) if lang == "python"))
    port = _free_port()
    serve = shlex.split(next(c for c in _code_commands() if c.startswith("blockdraft serve")))
    serve[serve.index("--port") + 1] = str(port)
    proc = subprocess.Popen([str(BIN / "blockdraft"), *serve[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                time.sleep(0.5)
        code = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip()
    finally:
        proc.terminate()
        proc.wait(30)


def test_links_in_the_readme_and_docs_point_at_files_that_exist():
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"\]\(([^)#\s]+)(#[^)]*)?\)", page.read_text()):
            if not m.group(1).startswith(("http://", "https://")) and not (page.parent / m.group(1)).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {m.group(1)}")
    assert not missing, missing
