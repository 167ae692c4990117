"""scripts/average_drafters.py: the weighted mean of drafters of one config, and refusals."""

import os
import runpy

import pytest
import torch

from blockdraft.checkpoint import load_draft, save_draft
from blockdraft.errors import BlockdraftError
from conftest import tiny_draft, tiny_target

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "average_drafters.py")


def _script():
    return runpy.run_path(SCRIPT)  # run_name is not __main__: defines, runs nothing


def test_weighted_mean_of_two_drafters(tmp_path):
    target = tiny_target()
    a, b = tiny_draft(target, seed=1), tiny_draft(target, seed=2)
    save_draft(a, tmp_path / "a")
    save_draft(b, tmp_path / "b")
    assert _script()["main"]([str(tmp_path / "soup"), str(tmp_path / "a"), str(tmp_path / "b"),
                              "--weights", "1", "3"]) == 0
    soup = load_draft(tmp_path / "soup").state_dict()
    sa, sb = a.state_dict(), b.state_dict()
    for k, v in soup.items():
        torch.testing.assert_close(v, 0.25 * sa[k] + 0.75 * sb[k])
    assert not torch.equal(soup["fc.weight"], sa["fc.weight"])


def test_refuses_other_configs_and_bad_weights(tmp_path):
    target = tiny_target()
    save_draft(tiny_draft(target, layers=2), tmp_path / "a")
    save_draft(tiny_draft(target, layers=1), tmp_path / "b")
    average = _script()["average"]
    with pytest.raises(BlockdraftError, match="config.json differs"):
        average([str(tmp_path / "a"), str(tmp_path / "b")])
    with pytest.raises(BlockdraftError, match="weights"):
        average([str(tmp_path / "a"), str(tmp_path / "a")], [1.0])
    with pytest.raises(BlockdraftError, match="at least two"):
        average([str(tmp_path / "a")])
    assert _script()["main"]([str(tmp_path / "c"), str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert not (tmp_path / "c").exists()
