"""`blockdraft chat` driven through a pseudo-terminal on the real SmolLM2 (slow; runs in CI)."""

import os
import pty
import select
import subprocess
import sys
import time

import pytest
import torch

from blockdraft.cli import load_engine
from blockdraft.decoding.engine import GenerationConfig

pytestmark = pytest.mark.slow
TURNS = ["What is the capital of France?", "And of Germany?"]
MAX_NEW = 12


class Pty:
    def __init__(self, args):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
        os.close(slave)
        self.transcript = ""

    def read_until(self, marker: str, timeout: float = 180) -> str:
        start = len(self.transcript)
        deadline = time.time() + timeout
        while marker not in self.transcript[start:]:
            assert time.time() < deadline, f"no {marker!r} in {self.transcript[start:]!r}"
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    self.transcript += os.read(self.master, 4096).decode(errors="replace").replace("\r\n", "\n")
                except OSError:  # the child closed the terminal
                    assert marker in self.transcript[start:], self.transcript[start:]
        return self.transcript[start:]

    def send(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")


def test_chat_answers_two_turns_and_exits_cleanly():
    torch.set_num_threads(2)
    engine = load_engine("smollm2-135m", None, "cpu")
    config = GenerationConfig(max_new_tokens=MAX_NEW)
    history, replies = [], []
    for turn in TURNS:  # what the engine answers for the same conversation
        history.append({"role": "user", "content": turn})
        reply = engine.generate(engine.target.encode_messages(history), config).text
        history.append({"role": "assistant", "content": reply})
        replies.append(reply)

    chat = Pty([sys.executable, "-m", "blockdraft.cli", "chat", "--max-new-tokens", str(MAX_NEW)])
    try:
        chat.read_until("you> ")
        for turn, reply in zip(TURNS, replies):
            chat.send(turn)
            out = chat.read_until("you> ")
            assert f"bot> {reply}\n[" in out, out  # streamed reply, then the stats line
            assert "tau" in out and "tok/s" in out
        chat.send("/reset")
        assert "(conversation reset)" in chat.read_until("you> ")
        chat.send("/exit")
        assert chat.proc.wait(timeout=30) == 0
    finally:
        if chat.proc.poll() is None:
            chat.proc.kill()
        os.close(chat.master)
