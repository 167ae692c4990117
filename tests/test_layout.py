"""The package's layout as docs/architecture.md draws it: imports flow one way between the
subpackages, and no module imports itself through others (no import circle, lazy imports inside
functions included)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "blockdraft"

# subpackage -> the subpackages it may import (besides itself and errors.py)
MAY_IMPORT = {
    "ops": set(),
    "models": {"ops"},
    "decoding": {"models", "ops"},
    "training": {"models", "ops", "evaluation"},  # evaluation: held-out tau by replay
    "serving": {"decoding", "models", "ops"},
    "evaluation": {"decoding", "models", "ops", "serving", "lab"},
    "lab": {"decoding", "models", "ops", "serving", "evaluation", "training"},
    "cli": {"decoding", "models", "ops", "serving", "evaluation", "training", "lab"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The package's modules `path` imports, at its top or inside functions."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("blockdraft")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("blockdraft"):
                continue
            for alias in node.names:  # `from . import few_rows` names a module (or one of the package's names)
                sub = f"{target}.{alias.name}"
                path = PACKAGE.parent / sub.replace(".", "/")
                init = PACKAGE.parent / target.replace(".", "/") / "__init__.py"
                named_there = init.exists() and alias.name in init.read_text()
                is_module = path.with_suffix(".py").exists() or (path / "__init__.py").exists()
                found.add(sub if is_module or (init.exists() and not named_there) else target)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def test_imports_flow_one_way_between_subpackages():
    wrong = []
    for module, targets in graph().items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] not in MAY_IMPORT:
            continue
        mine = parts[1]
        for t in targets:
            theirs = t.split(".")[1] if t.count(".") else None
            if theirs not in (None, mine, "errors") and theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{module} imports {t}")
    assert not wrong, wrong


def test_every_module_imported_exists():
    """A lazy import of a module that moved fails only when its command runs: found here."""
    modules = set(graph())
    missing = [f"{m} imports {t}" for m, targets in graph().items() for t in targets if t not in modules]
    assert not missing, missing


def test_no_module_imports_itself_through_others():
    g = graph()
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in list(g):
        if v not in index:
            visit(v)
    assert not circles, circles
