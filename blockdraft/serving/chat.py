"""`blockdraft chat`: an interactive terminal chat with streaming output and multi-turn history."""

from __future__ import annotations

import sys
from typing import Callable, TextIO

from ..decoding.engine import Engine, GenerationConfig, GenerationStats, TextStream

HELP = "Type a message and press Enter. /reset forgets the conversation, /exit (or Ctrl-D) quits."


def chat_loop(engine: Engine, config: GenerationConfig, system: str | None = None,
              read: Callable[[str], str] = input, out: TextIO = sys.stdout) -> None:
    target = engine.target
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    print(f"blockdraft chat with {target.name} ({'drafter' if engine.draft else 'no drafter'}). {HELP}", file=out)
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            print(file=out)
            return
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history = history[:1] if system else []
            print("(conversation reset)", file=out)
            continue
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]!r}. {HELP}", file=out)
            continue
        history.append({"role": "user", "content": line})
        ids = target.encode_messages(history)
        if len(ids) + 1 >= target.max_context:
            history.pop()
            print(f"(the conversation no longer fits the {target.max_context}-token context; /reset)", file=out)
            continue
        stats = GenerationStats()
        text = TextStream(target.tokenizer, config.stop_strings)
        out.write("bot> ")
        try:
            for step in engine.stream(ids, config, stats):
                out.write(text.push(step.tokens))
                out.flush()
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
            out.write(" [stopped]")
        out.write(text.finish())
        history.append({"role": "assistant", "content": text.text})
        n = len(text.tokens)
        tps = (n - 1) / stats.decode_seconds if stats.decode_seconds > 0 else float("nan")
        print(f"\n[{n} tokens, tau {stats.tau:.2f}, {tps:.1f} tok/s]", file=out, flush=True)
