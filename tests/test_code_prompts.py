"""`blockdraft prompts` (training/prompts.py): HumanEval-style prompts (signature and docstring, no body) with the
whole function as the response, read back by `blockdraft data`'s JSONL source."""

import json
import textwrap

from blockdraft.evaluation.datasets import HUMANEVAL_TEMPLATE
from blockdraft.cli import main
from blockdraft.training import prompts as P
from blockdraft.training.data import iter_jsonl

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

    prompts = P.stdlib_prompts(root)
    assert prompts == P.stdlib_prompts(root)  # a fixed order
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
    prompts = P.source_prompts({"liba": tmp_path / "liba", "libb": tmp_path / "libb"}, per_module=4)
    ids = [p["id"] for p in prompts]
    assert sorted(i.split(":")[0] for i in ids) == ["liba"] * 4 + ["libb"] * 4
    assert len(set(ids)) == 8
    assert prompts == P.source_prompts({"liba": tmp_path / "liba", "libb": tmp_path / "libb"}, per_module=4)


def test_prompts_command_writes_the_jsonl_and_refuses_bad_roots(tmp_path, capsys):
    for name in ("liba", "libb"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "many.py").write_text(_many(6))
    out = tmp_path / "code.jsonl"
    assert main(["prompts", str(out), "--root", str(tmp_path / "liba"), "--root", str(tmp_path / "libb"),
                 "--per-module", "3", "--limit", "5"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 5 and rows == P.source_prompts({"liba": tmp_path / "liba", "libb": tmp_path / "libb"},
                                                        per_module=3)[:5]
    assert f"{out}: 5 prompts" in capsys.readouterr().out
    assert not (tmp_path / "code.jsonl.partial").exists()
    assert main(["prompts", str(tmp_path / "x.jsonl"), "--root", str(tmp_path / "nope")]) == 2
    assert main(["prompts", str(tmp_path / "x.jsonl"), "--root", str(tmp_path / "liba"),
                 "--root", str(tmp_path / "liba")]) == 2  # two roots, one id prefix
    assert main(["prompts", str(tmp_path / "x.jsonl"), "--kind", "sharegpt-code", "--root", "stdlib"]) == 2
    assert main(["prompts", str(tmp_path / "x.jsonl"), "--limit", "0"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_sharegpt_code_prompts_hold_code_answers_and_leave_out_excluded_ids(tmp_path):
    rows, seen, excluded = P.sharegpt_code_prompts(limit=5)
    assert len(rows) == 5 and seen >= 5 and excluded == 0
    assert all("```" in r["response"] and len(r["prompt"]) <= 1000 for r in rows)
    data = tmp_path / "data"
    data.mkdir()
    (data / "samples.jsonl").write_text(json.dumps({"id": rows[0]["id"], "split": "train", "input_ids": [1, 2],
                                                    "loss_mask": [0, 1]}) + "\n")
    again, _, excluded = P.sharegpt_code_prompts([str(data)], limit=5)
    assert excluded == 1 and rows[0]["id"] not in {r["id"] for r in again}
    assert [r["id"] for r in again[:4]] == [r["id"] for r in rows[1:]]
