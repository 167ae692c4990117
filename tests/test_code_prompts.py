"""scripts/code_prompts.py: HumanEval-style prompts (signature and docstring, no body) with the
whole function as the response, read back by `blockdraft data`'s JSONL source."""

import json
import os
import runpy
import textwrap

from blockdraft.benchdata import HUMANEVAL_TEMPLATE
from blockdraft.data import iter_jsonl

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "code_prompts.py")
DOC = "Return the sum of a and b, which must both be numbers; raises TypeError otherwise."

MODULE = textwrap.dedent(f'''
    import os

    def add(a, b):
        """{DOC}"""
        return a + b

    def _private(x):
        """{DOC}"""
        return x

    def short(x):
        """Too short."""
        return x

    class Box:
        @staticmethod
        def scale(v, k=2):
            """{DOC}
            >>> Box.scale(2)
            4
            """
            return v * k
''')


def _many(n: int) -> str:
    """A module of n documented functions."""
    return "".join(f'def f{i}(x):\n    """{DOC}"""\n    return x + {i}\n\n' for i in range(n))


def test_code_prompts_hold_signature_and_docstring_and_the_whole_function_as_response(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "mod.py").write_text(MODULE)
    (root / "tests" / "mod.py").write_text(MODULE)  # test directories are skipped
    (root / "broken.py").write_text("def f(:\n")  # unparsable files are skipped
    (root / "many.py").write_text(_many(12))  # at most 8 functions from one module

    mod = runpy.run_path(SCRIPT)
    prompts = mod["stdlib_prompts"](root)
    assert prompts == mod["stdlib_prompts"](root)  # a fixed order
    ids = [p["id"] for p in prompts]
    assert len(ids) == len(set(ids)) == 2 + 8
    assert not any(i.startswith("stdlib:tests") or "_private" in i or ".short:" in i for i in ids)
    by_id = {p["id"]: p for p in prompts}

    add = by_id["stdlib:pkg.mod.add:4"]
    assert add["prompt"] == HUMANEVAL_TEMPLATE.format(prompt=f'def add(a, b):\n    """{DOC}"""\n')
    assert add["response"] == f'```python\ndef add(a, b):\n    """{DOC}"""\n    return a + b\n```'
    scale = next(p for i, p in by_id.items() if ".scale:" in i)
    assert "@staticmethod\ndef scale(v, k=2):" in scale["prompt"] and "return v * k" not in scale["prompt"]
    assert scale["response"].endswith("    return v * k\n```")

    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    read = list(iter_jsonl(path))
    assert [p.id for p in read] == ids
    assert read[0].messages == [{"role": "user", "content": prompts[0]["prompt"]}]
    assert read[0].response == prompts[0]["response"]


def test_code_prompts_from_several_roots_with_a_per_module_cap(tmp_path):
    for name in ("liba", "libb"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "many.py").write_text(_many(6))
    mod = runpy.run_path(SCRIPT)
    prompts = mod["source_prompts"]({"liba": tmp_path / "liba", "libb": tmp_path / "libb"}, per_module=4)
    ids = [p["id"] for p in prompts]
    assert sorted(i.split(":")[0] for i in ids) == ["liba"] * 4 + ["libb"] * 4
    assert len(set(ids)) == 8
    assert prompts == mod["source_prompts"]({"liba": tmp_path / "liba", "libb": tmp_path / "libb"}, per_module=4)
