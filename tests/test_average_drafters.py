"""`blockdraft average` (training/average.py): the weighted mean of drafters of one config, and refusals."""

import pytest
import torch

from blockdraft.models.checkpoint import load_draft, save_draft
from blockdraft.cli import main
from blockdraft.errors import BlockdraftError
from blockdraft.training.average import average
from conftest import tiny_draft, tiny_target

def test_weighted_mean_of_two_drafters(tmp_path):
    target = tiny_target()
    a, b = tiny_draft(target, seed=1), tiny_draft(target, seed=2)
    save_draft(a, tmp_path / "a")
    save_draft(b, tmp_path / "b")
    assert main(["average", str(tmp_path / "soup"), str(tmp_path / "a"), str(tmp_path / "b"),
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
    with pytest.raises(BlockdraftError, match="config.json differs"):
        average([str(tmp_path / "a"), str(tmp_path / "b")])
    with pytest.raises(BlockdraftError, match="weights"):
        average([str(tmp_path / "a"), str(tmp_path / "a")], [1.0])
    with pytest.raises(BlockdraftError, match="at least two"):
        average([str(tmp_path / "a")])
    assert main(["average", str(tmp_path / "c"), str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert not (tmp_path / "c").exists()


def test_the_average_may_be_written_in_half_precision(tmp_path):
    target = tiny_target()
    save_draft(tiny_draft(target, seed=1), tmp_path / "a")
    save_draft(tiny_draft(target, seed=2), tmp_path / "b")
    assert main(["average", str(tmp_path / "soup"), str(tmp_path / "a"), str(tmp_path / "b"), "--dtype", "float16"]) == 0
    from safetensors.torch import load_file

    assert {v.dtype for v in load_file(str(tmp_path / "soup" / "model.safetensors")).values()} == {torch.float16}
