"""`blockdraft export`: the exact command that serves a drafter with vLLM or SGLang."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import BlockdraftError
from .common import bundled_drafter

VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's server reads its API key from here as from --api-key


def peer_command(fmt: str, target: str, draft: str | None, block_size: int | None, dtype: str, port: int,
                 model_name: str | None, python: str, cpu: bool, host: str | None = None, api_key: str | None = None):
    """The peer's LaunchCommand for a blockdraft target name and drafter (default: the bundled one)."""
    from ..serving.peers import drafter_block_size, launch_command

    if draft == "none":
        raise BlockdraftError("a peer server speculates with a drafter; --draft none has nothing to export")
    path = Path(draft) if draft else bundled_drafter(target)
    if path is None or not (path / "config.json").is_file():
        raise BlockdraftError(f"drafter {str(path) if path else '(bundled)'} has no config.json; pass --draft DIR")
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
               model_name: str | None, python: str, cpu: bool, out: str | None) -> None:
    cmd = peer_command(fmt, target, draft, block_size, dtype, port, model_name, python, cpu)
    if out:
        Path(out).write_text("#!/bin/sh\n# written by blockdraft export\nexec " + cmd.shell() + "\n")
        os.chmod(out, os.stat(out).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        print(f"wrote {out}")
    else:
        print(cmd.shell())


def add_parsers(sub) -> None:
    e = sub.add_parser("export", help="print (or write) the command that serves a drafter with vLLM or SGLang",
                       description="vLLM and SGLang load blockdraft drafters unchanged. This prints their launch "
                       "command: method dflash, num_speculative_tokens = block size - 1 (vLLM), "
                       "--speculative-num-draft-tokens = block size (SGLang).")
    e.add_argument("--format", dest="fmt", choices=["vllm", "sglang"], required=True)
    e.add_argument("--target", default="smollm2-135m", help="smollm2-135m, a local HF directory, or a hub id")
    e.add_argument("--draft", default=None, help="drafter directory (default: the bundled one)")
    e.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the peer's dtype (float32: the exact comparison with blockdraft on the CPU)")
    e.add_argument("--port", type=int, default=8000)
    e.add_argument("--model-name", default=None, help="the model id clients ask for (default: --target)")
    e.add_argument("--python", default="python", help="the interpreter of the peer's environment")
    e.add_argument("--cpu", action="store_true", help="vLLM's CPU build: eager mode, no cores reserved")
    e.add_argument("--out", default=None, metavar="FILE.sh", help="write an executable launch script instead")
    e.set_defaults(run=cmd_export)
