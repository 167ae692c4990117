"""What the commands share: the bundled drafter, prompt files, dtypes, loading an engine, and the
arguments several commands take. Standard library only at import, like every cli module."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import BlockdraftError
from ..evaluation.methods import DRAFT_DTYPES as METHOD_DRAFT_DTYPES

BUNDLED_DRAFTERS = Path(__file__).parent.parent / "drafters"


def bundled_drafter(target: str) -> Path | None:
    path = BUNDLED_DRAFTERS / target
    return path if (path / "model.safetensors").exists() else None


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[dict]:
    if (prompt is None) == (prompts_file is None):
        raise BlockdraftError("give exactly one of --prompt or --prompts-file")
    if prompt is not None:
        return [{"prompt": prompt}]
    rows = []
    try:
        lines = Path(prompts_file).read_text().splitlines()
    except OSError as err:
        raise BlockdraftError(f"cannot read --prompts-file: {err}") from err
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise BlockdraftError(f"{prompts_file}:{n}: invalid JSON ({err.msg})") from err
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise BlockdraftError(f'{prompts_file}:{n}: expected {{"prompt": "...", "seed": optional int}}')
        if rec.get("seed") is not None and not isinstance(rec["seed"], int):
            raise BlockdraftError(f"{prompts_file}:{n}: seed must be an integer")
        rows.append(rec)
    if not rows:
        raise BlockdraftError(f"{prompts_file}: no prompts")
    return rows


DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFT_DTYPES = ("auto",) + METHOD_DRAFT_DTYPES  # int8: the drafter's weights only, computed in fp32


def parse_dtype(name: str, choices: tuple = DTYPES):
    """'auto' -> None (the default for the device), else the torch dtype of that name."""
    import torch

    if name not in choices:
        raise BlockdraftError(f"unknown dtype {name!r}; choose from {list(choices)}")
    return None if name == "auto" else getattr(torch, name)


def load_engine(target: str, draft: str | None, device: str | None = None, dtype: str = "auto",
                draft_dtype: str = "auto", activations: str = "float32"):
    """The target plus the drafter: a path, 'none', or None for the bundled one (if any).
    dtype: the target's ('auto': fp32 on the CPU, bf16 on CUDA); draft_dtype: the drafter's
    ('auto': `fast_draft_dtype`); activations: "int8" turns on a GGUF target's int8-activation mode
    (ops/int8_activations.py) for this process."""
    from ..models.checkpoint import load_draft
    from ..decoding.engine import Engine
    from ..ops.precision import fast_draft_dtype
    from ..models.target import load_target

    if draft is not None and draft != "none" and not Path(draft).exists():
        raise BlockdraftError(f"drafter checkpoint {draft!r} does not exist")
    target_dtype, chosen_draft_dtype = parse_dtype(dtype), parse_dtype(draft_dtype, DRAFT_DTYPES)
    tgt = load_target(target, device=device, dtype=target_dtype)
    if activations == "int8":
        from ..ops import int8_activations

        int8_activations.require(tgt)
        int8_activations.use(True)
    elif activations != "float32":
        raise BlockdraftError(f"--activations is float32 or int8 (got {activations!r})")
    path = bundled_drafter(target) if draft is None else (None if draft == "none" else Path(draft))
    drafter = load_draft(path, device=tgt.device, dtype=tgt.dtype) if path else None
    return Engine(tgt, drafter, draft_dtype=chosen_draft_dtype or fast_draft_dtype(tgt.device, tgt.dtype))


def add_dtype_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the target's dtype (auto: float32 on the CPU, exact; bfloat16 on CUDA). bf16 on the CPU "
                        "is an opt-in whose speculative output may differ from plain bf16 decoding (see docs)")
    p.add_argument("--draft-dtype", default="auto", choices=DRAFT_DTYPES,
                   help="the drafter's dtype; it cannot change the output (auto: see precision.fast_draft_dtype; "
                        "on a CPU with the few-row kernel, bfloat16 and int8 store the drafter's weights in "
                        "that type and compute in float32)")


def add_activations_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", default="float32", choices=("float32", "int8"),
                   help="a GGUF target's activations: float32 (exact: bitwise its dequantized weights, the default) "
                        "or int8 (faster, as llama.cpp computes; needs AVX-512 VNNI; speculative output equals "
                        "this mode's own plain decoding, not float32's)")


def add_coupling_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coupling", choices=["gumbel", "rejection"], default="gumbel",
                   help="at temperature > 0: gumbel (the default) ties each position's draw to the seed, so a "
                        "seed gives plain sampling's text whatever the speculation; rejection: drafts verified "
                        "by rejection sampling (docs/sampling.md)")


def add_tree_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree", type=int, default=None, metavar="N",
                   help="verify token trees of up to N nodes instead of chains, the lookup continuation as one "
                        "more branch, N adaptive per step unless --block-size is given; 0: chains (default: 16 "
                        "for greedy decoding at adaptive blocks, else chains: GenerationConfig.trees)")


def tree_option(tree: int | None) -> int | str | None:
    """`--tree` as `GenerationConfig.tree_budget`: unset, "auto" (the config's rule); 0, chains (None)."""
    return "auto" if tree is None else (tree or None)


def add_lookup_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="also verify prompt-lookup proposals (text repeated from the context) where they pay "
                        "(default: on; --no-lookup: the drafter alone)")
