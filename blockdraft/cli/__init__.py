"""The `blockdraft` command. Each subcommand is one typed function, grouped by verb:
decode.py (generate, chat, serve), evaluate.py (bench, tau, bench-serve), train.py (init, data,
train, vocab, merge-data, average, prompts, accuracy, plot-training, ablate), export.py (export).
Modules here import the standard library only; each command imports what it needs when it runs."""

from __future__ import annotations

import argparse
import sys

from ..errors import BlockdraftError
from . import decode, evaluate, export, train
from .common import bundled_drafter, load_engine, parse_dtype, read_prompts
from .decode import cmd_chat, cmd_generate, cmd_serve

__all__ = ["build_parser", "main", "bundled_drafter", "load_engine", "parse_dtype", "read_prompts",
           "cmd_chat", "cmd_generate", "cmd_serve"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockdraft", description="Lossless DFlash speculative decoding")
    sub = p.add_subparsers(dest="command", required=True)
    for group in (decode, evaluate, train, export):
        group.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command, run = args.pop("command"), args.pop("run")
    try:
        run(**args)
    except BlockdraftError as err:
        print(f"blockdraft {command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0
