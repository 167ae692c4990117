"""What the server tests share (no tests here): a tiny random target with SmolLM2's tokenizer and
chat template saved as a model directory (`blockdraft serve --target DIR` loads it in a second),
the server in a thread or in a process of its own on a free loopback port, and readers of its
server-sent events and metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny"
CONTEXT = 2048


def save_tiny_chat_target(path: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (and chat template), so that text, chat and
    stop strings work as with a real model, at a millisecond a token. Weights drawn wide
    (initializer_range 0.3): the text varies from prompt to prompt instead of repeating one token."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from blockdraft.models.target import resolve_target_path

    tok = AutoTokenizer.from_pretrained(resolve_target_path("smollm2-135m"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      tie_word_embeddings=True, initializer_range=0.3, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_chat_target(tmp_path_factory.mktemp("tiny-chat"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn on a free loopback port in a background thread (the engine worker in another)."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


class ServerProcess:
    """A server in a process of its own (`argv` must serve on `port`), up once /health answers.
    Its output goes to a file (a pipe nobody reads could fill and stall it); `output()` reads it."""

    def __init__(self, argv: list[str], port: int, env: dict | None = None):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def __enter__(self):
        deadline = time.time() + 180
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited early:\n{self.output()}")
            assert time.time() < deadline, "the server did not come up"
            try:
                httpx.get(self.url + "/health", timeout=5)
                return self
            except httpx.TransportError:
                time.sleep(0.2)

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


def serve_command(target: Path, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "blockdraft.cli", "serve", "--target", str(target), "--draft", "none",
            "--model-name", MODEL, "--device", "cpu", "--port", str(port), *args]


@dataclass
class Streamed:
    """What a streaming client saw: the text, the last chunk's finish_reason, whether `[DONE]`
    came, and any error event."""

    text: str = ""
    finish_reason: str | None = None
    done: bool = False
    error: dict | None = None
    usage: dict | None = None
    chunks: list[dict] = field(default_factory=list)


def read_sse(lines, chat: bool) -> Streamed:
    out = Streamed()
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            out.done = True
            break
        obj = json.loads(data)
        if "error" in obj:
            out.error = obj["error"]
            continue
        out.chunks.append(obj)
        for choice in obj.get("choices", []):
            out.text += (choice["delta"].get("content") or "") if chat else choice["text"]
            out.finish_reason = choice["finish_reason"] or out.finish_reason
        out.usage = obj.get("usage") or out.usage
    return out


def chat_body(content: str, max_tokens: int, stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}


def metric(text: str, name: str) -> float:
    """A sample's value in Prometheus text (0 when absent); `name` with its labels, as written."""
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def wait_for(condition, timeout: float = 30, what: str = "the condition") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
