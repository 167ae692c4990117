"""Prompt sets for `blockdraft data --source FILE.jsonl`, written by `blockdraft prompts`.

`--kind code`: HumanEval-style coding prompts made from Python source trees (the standard library
by default). Each prompt is a function's signature and docstring (no body), in the chat wording our
HumanEval benchmark uses; its "response" is the whole function in a python block, for
`--responses dataset` (prefill only, with the target's own predictions as labels: about 6x faster
than regenerating). The target's answers to such prompts copy the signature and docstring and then
write a body: text a drafter meets on HumanEval but rarely in ShareGPT chat. The stdlib holds none
of the HumanEval problems, so the benchmark stays out of the training data. Functions are taken in
a fixed order (a seeded shuffle), at most 8 per module (`--per-module`), public names only,
docstrings of 60 to 700 characters; tests, demos and vendored code are skipped. `--root`
(repeatable) reads other source trees instead, e.g. pure-Python packages installed by `make setup`
(their ids start with the root's folder name; the stdlib's with "stdlib").

`--kind sharegpt-code`: the ShareGPT records whose first answer holds a code block (prompt and
original answer), leaving out the ids that `--exclude` data directories already hold. Prompts
over 1,000 characters are skipped (`blockdraft data` drops prompts over 256 tokens anyway).
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import textwrap
from pathlib import Path

from ..errors import BlockdraftError
from ..evaluation.datasets import HUMANEVAL_TEMPLATE

SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip", "__pycache__"}
PER_MODULE = 8


def _stub(lines: list[str], node: ast.FunctionDef) -> tuple[str, str] | None:
    """The function's `def` line(s) and docstring, and the whole function, dedented; None if it
    has no usable docstring."""
    doc = ast.get_docstring(node, clean=False)
    if not doc or not 60 <= len(doc) <= 700:
        return None
    first = node.body[0]  # the docstring
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    stub = "\n".join(lines[start : first.end_lineno])
    whole = "\n".join(lines[start : node.end_lineno])
    return textwrap.dedent(stub).rstrip() + "\n", textwrap.dedent(whole).rstrip() + "\n"


def stdlib_prompts(root: Path, seed: int = 0, per_module: int = PER_MODULE) -> list[dict]:
    return source_prompts({"stdlib": root}, seed, per_module)


def source_prompts(roots: dict[str, Path], seed: int = 0, per_module: int = PER_MODULE) -> list[dict]:
    """Prompts from each source tree (id prefix -> root), in one seeded order."""
    out = []
    for prefix, root in roots.items():
        out += _root_prompts(root, prefix, seed, per_module)
    random.Random(seed).shuffle(out)
    return out


def _root_prompts(root: Path, prefix: str, seed: int, per_module: int) -> list[dict]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or rel.name.startswith(("test_", "_")):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        lines = source.splitlines()
        found = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                parts = _stub(lines, node)
                if parts:
                    found.append((f"{prefix}:{module}.{node.name}:{node.lineno}", *parts))
        random.Random(f"{seed}:{module}").shuffle(found)
        out += [{"id": i, "prompt": HUMANEVAL_TEMPLATE.format(prompt=stub), "response": f"```python\n{whole}```"}
                for i, stub, whole in found[:per_module]]
    return out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def code_roots(roots: list[str] | None) -> dict[str, Path]:
    """Id prefix -> source tree for `--root` values ('stdlib' or a directory; default: stdlib)."""
    stdlib = stdlib_root()
    paths = [stdlib if r == "stdlib" else Path(r) for r in roots or ["stdlib"]]
    missing = [str(r) for r in paths if not r.is_dir()]
    if missing:
        raise BlockdraftError(f"not a directory: {', '.join(missing)}")
    # the id prefix: "stdlib", or the folder's name (two roots of one name would share ids)
    out = {"stdlib" if r.resolve() == stdlib.resolve() else r.name: r for r in paths}
    if len(out) < len(paths):
        raise BlockdraftError("two --root folders give the same id prefix (the same folder, or the same folder name)")
    return out


def sharegpt_code_prompts(exclude: list[str] = (), limit: int = 3000) -> tuple[list[dict], int, int]:
    """(records, records read, ids excluded): ShareGPT first turns whose answer holds a code block."""
    from .data import iter_sharegpt, load_samples

    used = {r["id"] for d in exclude for r in load_samples(d, None)}
    out, seen = [], 0
    for p in iter_sharegpt():
        if len(out) >= limit:
            break
        seen += 1
        if p.id in used or not p.response or "```" not in p.response or len(p.messages[0]["content"]) > 1000:
            continue
        out.append({"id": p.id, "prompt": p.messages[0]["content"], "response": p.response})
    return out, seen, len(used)


def write_jsonl(path: str, rows: list[dict]) -> None:
    """Write atomically: an interrupted run leaves no half-written prompt file."""
    tmp = Path(path).with_name(Path(path).name + ".partial")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)
