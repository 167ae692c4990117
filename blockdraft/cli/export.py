"""`blockdraft export`: the exact command that serves a drafter with vLLM or SGLang, or the drafter
written as a GGUF for llama.cpp (models/gguf_export.py)."""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

from ..errors import BlockdraftError
from .common import bundled_drafter

VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's server reads its API key from here as from --api-key


def drafter_dir(target: str, draft: str | None) -> Path:
    """--draft DIR, else the target's bundled drafter; refused if it has no config.json."""
    if draft == "none":
        raise BlockdraftError("a peer server speculates with a drafter; --draft none has nothing to export")
    path = Path(draft) if draft else bundled_drafter(target)
    if path is None or not (path / "config.json").is_file():
        raise BlockdraftError(f"drafter {str(path) if path else '(bundled)'} has no config.json; pass --draft DIR")
    return path


def export_gguf(target: str, draft: str | None, target_gguf: str | None, out: str | None, outtype: str):
    """Writes the drafter as a GGUF llama.cpp's draft-dflash loads (a gguf_export.DraftGGUF)."""
    from ..models.gguf_export import export_drafter, read_target
    from ..models.target import SMOLLM2_ALIAS, SMOLLM2_GGUF, smollm2_gguf_dir

    if not out:
        raise BlockdraftError("--format gguf writes a file: pass --out FILE.gguf")
    if target_gguf is None and target.endswith(".gguf") and Path(target).is_file():
        target_gguf = target  # a GGUF target is its own
    if target_gguf is None:
        if target != SMOLLM2_ALIAS:
            raise BlockdraftError("--format gguf needs the target's GGUF (its tokenizer goes into the drafter's "
                                  "GGUF, and llama-server runs it): pass --target-gguf FILE")
        target_gguf = str(smollm2_gguf_dir() / SMOLLM2_GGUF)
    return export_drafter(drafter_dir(target, draft), read_target(target_gguf), out, outtype)


def peer_command(fmt: str, target: str, draft: str | None, block_size: int | None, dtype: str, port: int,
                 model_name: str | None, python: str, cpu: bool, host: str | None = None, api_key: str | None = None):
    """The peer's LaunchCommand for a blockdraft target name and drafter (default: the bundled one)."""
    from ..serving.peers import drafter_block_size, launch_command

    path = drafter_dir(target, draft)
    import json

    from ..models.checkpoint import STUDY_ARCHITECTURE
    from ..models.target import SMOLLM2_ALIAS, resolve_target_path

    if STUDY_ARCHITECTURE in (json.loads((path / "config.json").read_text()).get("architectures") or []):
        raise BlockdraftError(f"{path} is a `blockdraft ablate` variant (input fusion or no target context), "
                              "which only blockdraft runs; vLLM and SGLang run standard DFlash drafters")

    if target == SMOLLM2_ALIAS or Path(target).exists():
        target_dir = str(resolve_target_path(target).resolve())
    else:
        target_dir = target  # a hub id the peer may download itself
    try:
        cmd = launch_command(fmt, target_dir, str(path.resolve()), block_size or drafter_block_size(path), dtype,
                             port, model_name or target, python, cpu)
    except ValueError as err:
        raise BlockdraftError(str(err)) from err
    if host:
        cmd.argv += ["--host", host]
    if api_key:  # in the environment, not argv (any user of the machine can read a command line)
        if fmt != "vllm":
            raise BlockdraftError("an API key can be handed to vLLM only")
        cmd.secrets[VLLM_API_KEY_ENV] = api_key
    return cmd


def cmd_export(fmt: str, target: str, draft: str | None, block_size: int | None, dtype: str, port: int,
               model_name: str | None, python: str, cpu: bool, out: str | None, target_gguf: str | None = None,
               outtype: str = "auto") -> None:
    if fmt == "gguf":
        if block_size is not None:
            raise BlockdraftError("--block-size is llama-server's --spec-draft-n-max (block size - 1), "
                                  "not part of the GGUF; the GGUF carries the drafter's trained block")
        written = export_gguf(target, draft, target_gguf, out, outtype)
        print(f"wrote {written.path} ({written.n_tensors} tensors, {written.n_bytes / 1e6:.1f} MB, block size "
              f"{written.block_size}); serve it with llama.cpp's server:")
        print(f"llama-server -m {shlex.quote(str(written.target))} -md {shlex.quote(str(written.path))} "
              f"--spec-type draft-dflash --spec-draft-n-max {written.block_size - 1}")
        return
    if target_gguf is not None or outtype != "auto":
        raise BlockdraftError("--target-gguf and --outtype are for --format gguf")
    cmd = peer_command(fmt, target, draft, block_size, dtype, port, model_name, python, cpu)
    if out:
        Path(out).write_text("#!/bin/sh\n# written by blockdraft export\nexec " + cmd.shell() + "\n")
        os.chmod(out, os.stat(out).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        print(f"wrote {out}")
    else:
        print(cmd.shell())


def add_parsers(sub) -> None:
    e = sub.add_parser("export", help="print (or write) the command that serves a drafter with vLLM or SGLang, "
                       "or write it as a GGUF for llama.cpp",
                       description="vLLM and SGLang load blockdraft drafters unchanged. This prints their launch "
                       "command: method dflash, num_speculative_tokens = block size - 1 (vLLM), "
                       "--speculative-num-draft-tokens = block size (SGLang). --format gguf writes the drafter "
                       "as a GGUF (--out) that llama-server loads with -md FILE --spec-type draft-dflash.")
    e.add_argument("--format", dest="fmt", choices=["vllm", "sglang", "gguf"], required=True)
    e.add_argument("--target", default="smollm2-135m", help="smollm2-135m, a local HF directory, or a hub id")
    e.add_argument("--draft", default=None, help="drafter directory (default: the bundled one)")
    e.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the peer's dtype (float32: the exact comparison with blockdraft on the CPU)")
    e.add_argument("--port", type=int, default=8000)
    e.add_argument("--model-name", default=None, help="the model id clients ask for (default: --target)")
    e.add_argument("--python", default="python", help="the interpreter of the peer's environment")
    e.add_argument("--cpu", action="store_true", help="vLLM's CPU build: eager mode, no cores reserved")
    e.add_argument("--out", default=None, metavar="FILE",
                   help="vllm, sglang: write an executable launch script instead; gguf: the GGUF to write (required)")
    e.add_argument("--target-gguf", default=None, metavar="FILE",
                   help="gguf: the target's GGUF, whose tokenizer the drafter's GGUF carries "
                   "(default for smollm2-135m: the bundled Q4_1 file)")
    e.add_argument("--outtype", default="auto", choices=["auto", "f32", "f16", "bf16"],
                   help="gguf: the type of the drafter's matrices (auto: the checkpoint's own; norms are always f32)")
    e.set_defaults(run=cmd_export)
