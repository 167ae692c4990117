"""Write HumanEval-style coding prompts made from the Python standard library, as a JSONL that
`blockdraft data --source` reads.

    python scripts/code_prompts.py OUT.jsonl [--limit N] [--root DIR ...] [--per-module N]

Each prompt is a function's signature and docstring (no body), in the chat wording our HumanEval
benchmark uses; its "response" is the whole function in a python block, for `--responses dataset`
(prefill only, with the target's own predictions as labels: about 6x faster than regenerating).
The target's answers to such prompts copy the signature and docstring and then write a body:
text a drafter meets on HumanEval but rarely in ShareGPT chat. The stdlib holds none of the
HumanEval problems, so the benchmark stays out of the training data.
Functions are taken in a fixed order (a seeded shuffle), at most 8 per module (`--per-module`),
public names only, docstrings of 60 to 700 characters; tests, demos and vendored code are skipped.
`--root` (repeatable) reads other source trees instead, e.g. pure-Python packages installed by
`make setup` (their ids start with the root's folder name; the stdlib's with "stdlib").
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
import textwrap
from pathlib import Path

from blockdraft.benchdata import HUMANEVAL_TEMPLATE

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--root", action="append", help="directory of .py files, or 'stdlib' (repeatable; default: stdlib)")
    ap.add_argument("--per-module", type=int, default=PER_MODULE, help="at most this many functions per module")
    args = ap.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = [stdlib if r == "stdlib" else Path(r) for r in args.root or ["stdlib"]]
    missing = [str(r) for r in paths if not r.is_dir()]
    if missing:
        ap.error(f"not a directory: {', '.join(missing)}")
    # the id prefix: "stdlib", or the folder's name (two roots of one name would share ids)
    roots = {"stdlib" if r.resolve() == stdlib.resolve() else r.name: r for r in paths}
    if len(roots) < len(paths):
        ap.error("two --root folders give the same id prefix (the same folder, or the same folder name)")
    prompts = source_prompts(roots, per_module=args.per_module)[: args.limit]
    with open(args.out, "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    print(f"{args.out}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
