"""Training state under kills (issue 49): a run killed anywhere, a save included, resumes from
its newest checkpoint (never silently from step 0) to the weights an uninterrupted run ends with,
bit for bit; a drafter directory never loads as the config of one save with the weights of
another; `--resume` refuses another run's settings.

The first two tests kill at every file operation of the saves in turn (an exception in place of
the operation: exhaustive, in process, fast); the last runs the real `blockdraft train` command and
SIGKILLs it, at random moments and inside saves."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from blockdraft.errors import BlockdraftError
from blockdraft.models.checkpoint import load_draft, save_draft
from blockdraft.training import train as T

from conftest import tiny_draft, tiny_target
from test_train import _cfg, tiny_run  # noqa: F401  (tiny_run: the tiny target and data, a fixture)

# what makes a save take effect or undoes one: every rename, replace, unlink and tree removal
FILE_OPERATIONS = ((os, "rename"), (os, "replace"), (os, "unlink"), (shutil, "rmtree"))


class Killed(BaseException):
    """The process dies here. A BaseException, so that no `except Exception` in the code under
    test can carry on as a killed process could not."""


def _kill_at(monkeypatch, k: int, root) -> None:
    """Make the k-th file operation (from 1) on a path under `root` raise Killed, before it runs."""
    count, inside = [0], os.path.join(str(root), "")

    def wrap(real):
        def operation(path, *args, **kwargs):
            if str(path).startswith(inside):
                count[0] += 1
                if count[0] == k:
                    raise Killed
            return real(path, *args, **kwargs)
        return operation

    for module, name in FILE_OPERATIONS:
        monkeypatch.setattr(module, name, wrap(getattr(module, name)))


def _logged_steps(out) -> list[int]:
    """The training steps log.jsonl records, in order (a line a kill cut short is skipped)."""
    steps = []
    for line in (out / "log.jsonl").read_text().splitlines() if (out / "log.jsonl").exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row:
            steps.append(row["step"])
    return steps


def _assert_equal_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _state_tensors(out) -> dict:
    [state] = sorted(out.glob("state-*"))  # exactly one checkpoint is kept
    return load_file(str(state / "state.safetensors"))


def test_a_kill_at_any_file_operation_resumes_to_the_uninterrupted_weights(tiny_run, tmp_path, monkeypatch):
    """Kill the k-th file operation of a run saving every step, for every k; resume. Before issue 49
    a kill between the checkpoint's two renames left only `state.old`, and `--resume` started
    again at step 0 (its weights would even come out equal: a restart replays the same run, so
    the steps trained after the kill are what tells)."""
    def cfg(out):
        return _cfg(tiny_run, out, max_steps=3, save_every=1)

    T.train(cfg(tmp_path / "whole"), progress=False)
    want = load_file(str(tmp_path / "whole" / "drafter" / "model.safetensors"))
    k = 0
    while True:
        k += 1
        out = tmp_path / f"kill-{k}"
        with monkeypatch.context() as m:
            _kill_at(m, k, out)
            try:
                T.train(cfg(out), progress=False)
                break  # k is past the run's last file operation
            except Killed:
                pass
        before = _logged_steps(out)
        T.train(cfg(out), resume=True, progress=False)
        after = _logged_steps(out)[len(before):]
        if before and after:  # at most the step whose save the kill interrupted is trained again
            assert after[0] >= before[-1], f"kill {k}: resumed at step {after[0]} after step {before[-1]}"
        _assert_equal_tensors(load_file(str(out / "drafter" / "model.safetensors")), want)
    assert k > 12  # the kills went through every save, not only the first


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    same_subset = (a.vocab_ids is None) == (b.vocab_ids is None) and (
        a.vocab_ids is None or torch.equal(a.vocab_ids, b.vocab_ids))
    return same_subset and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("old_subset,new_subset", [(False, False), (True, False), (False, True), (True, True)])
def test_a_kill_inside_save_draft_leaves_the_old_drafter_the_new_one_or_a_refusal(tmp_path, monkeypatch,
                                                                                    old_subset, new_subset):
    """Before issue 49 a kill between the weights' replace and config.json's loaded the new
    weights under the old config; here, of the same shape, they would load without a word."""
    target = tiny_target("llama")
    old, new = tiny_draft(target, seed=1), tiny_draft(target, seed=2)
    old.vocab_ids = torch.tensor([1, 4, 9]) if old_subset else None
    new.vocab_ids = torch.tensor([2, 5, 7, 11]) if new_subset else None
    outcomes, k = set(), 0
    while True:
        k += 1
        d = tmp_path / f"kill-{k}"
        save_draft(old, d)
        with monkeypatch.context() as m:
            _kill_at(m, k, d)
            try:
                save_draft(new, d)
                finished = True
            except Killed:
                finished = False
        try:
            got = load_draft(d)
            assert _same(got, old) or _same(got, new), f"kill {k}: a drafter of two saves loaded"
            outcomes.add("old" if _same(got, old) else "new")
        except BlockdraftError as err:
            assert "different saves" in str(err)
            outcomes.add("refused")
        save_draft(new, d)  # the next save repairs it
        assert _same(load_draft(d), new)
        if finished:
            break
    assert {"old", "new"} <= outcomes


def test_a_drafter_saved_twice_is_the_same_files(tmp_path):
    """The save's stamp is a digest of its contents, not a random id: saving is reproducible."""
    draft = tiny_draft(tiny_target("llama"))
    draft.vocab_ids = torch.tensor([3, 8])
    for d in ("a", "b"):
        save_draft(draft, tmp_path / d)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert [str(f) for f in files] == ["config.json", "model.safetensors", "vocab/draft_vocab.safetensors"]
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_resume_refuses_other_settings_and_names_them(tiny_run, tmp_path):
    from blockdraft.training.state import latest_state

    out = tmp_path / "run"
    T.train(_cfg(tiny_run, out, max_steps=2), progress=False)
    with pytest.raises(BlockdraftError) as err:
        T.train(_cfg(tiny_run, out, max_steps=4, lr=1e-3, seed=1, log_every=2), resume=True, progress=False)
    message = str(err.value)
    assert "lr (0.003 -> 0.001)" in message and "seed (0 -> 1)" in message
    assert "max_steps (" not in message and "log_every (" not in message  # these may change
    with pytest.raises(BlockdraftError, match="num_layers"):
        T.train(_cfg(tiny_run, out, max_steps=4, num_layers=3), resume=True, progress=False)
    with pytest.raises(BlockdraftError, match="past --max-steps 1"):
        T.train(_cfg(tiny_run, out, max_steps=1), resume=True, progress=False)
    assert _logged_steps(out) == [1, 2]  # refused before any work
    T.train(_cfg(tiny_run, out, max_steps=3, log_every=3, eval_every=0), resume=True, progress=False)
    assert latest_state(out).name == "state-00000003"


def test_the_old_layouts_state_old_is_resumed_and_a_damaged_checkpoint_refused(tiny_run, tmp_path):
    """The layout before issue 49, killed between its two renames, held only `state.old`: resumed
    from it, not from step 0. A checkpoint that cannot be read is refused, never skipped."""
    from blockdraft.training.state import latest_state

    out = tmp_path / "run"
    T.train(_cfg(tiny_run, out, max_steps=2), progress=False)
    os.rename(latest_state(out), out / "state.old")
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a line a kill cut short
    with pytest.raises(BlockdraftError, match="--resume"):  # it is a run: not started again over it
        T.train(_cfg(tiny_run, out, max_steps=4), progress=False)
    T.train(_cfg(tiny_run, out, max_steps=4), resume=True, progress=False)
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]  # every line whole
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "drafter", "log.jsonl", "state-00000004"]

    state = latest_state(out) / "state.safetensors"
    state.write_bytes(state.read_bytes()[:-100])  # truncated, as by a disk that lost its tail
    with pytest.raises(BlockdraftError, match="damaged"):
        T.train(_cfg(tiny_run, out, max_steps=6), resume=True, progress=False)
    assert _logged_steps(out) == [1, 2, 3, 4]

    old = tmp_path / "old"  # the old layout, its newer checkpoint unreadable: refused, not passed over
    T.train(_cfg(tiny_run, old, max_steps=2), progress=False)
    os.rename(latest_state(old), old / "state.old")
    (old / "state").mkdir()
    with pytest.raises(BlockdraftError, match="move it aside to resume from state.old"):
        T.train(_cfg(tiny_run, old, max_steps=4), resume=True, progress=False)


# The real command under real SIGKILLs. A kill at a random moment mostly lands between saves, so
# some kills are aimed: this wrapper runs `blockdraft train` with the k-th file operation under
# KILL_ROOT replaced by SIGKILL to itself (no exception handler, no `finally`, no buffer flushed).
_KILL_AT_OPERATION = """
import os, shutil, signal, sys
root, k, count = os.path.join(os.environ["KILL_ROOT"], ""), int(os.environ["KILL_AT"]), [0]
def wrap(real):
    def operation(path, *args, **kwargs):
        if str(path).startswith(root):
            count[0] += 1
            if count[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(path, *args, **kwargs)
    return operation
for module, name in ((os, "rename"), (os, "replace"), (os, "unlink"), (shutil, "rmtree")):
    setattr(module, name, wrap(getattr(module, name)))
from blockdraft.cli import main
sys.exit(main(sys.argv[1:]))
"""
STEPS = 60


def _train_command(root, data, out) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--target", str(root / "target"), "--num-layers", "2",
            "--block-size", "6", "--anchors", "4", "--batch-size", "4", "--max-steps", str(STEPS), "--lr", "3e-3",
            "--log-every", "1", "--save-every", "1", "--resume"]


def _run(args: list[str], stderr, kill_root=None, kill_at: int | None = None) -> subprocess.Popen:
    """Start `blockdraft ARGS` (stderr to a file: a pipe nobody reads could fill and block it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kill_at is None:
        cmd = [sys.executable, "-m", "blockdraft.cli", *args]
    else:
        env.update(KILL_ROOT=str(kill_root), KILL_AT=str(kill_at))
        cmd = [sys.executable, "-c", _KILL_AT_OPERATION, *args]
    with open(stderr, "w") as err:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)


def _kill_while_training(proc: subprocess.Popen, out, steps: int, delay: float) -> None:
    """SIGKILL `proc` `delay` seconds after it has logged `steps` more steps: somewhere in a step,
    its save included (counted in steps, not seconds, so that the kills fall alike on a fast
    machine and a busy one)."""
    start = len(_logged_steps(out))
    while proc.poll() is None and len(_logged_steps(out)) < start + steps:
        time.sleep(0.002)
    time.sleep(delay)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)


@pytest.mark.slow
def test_sigkilled_training_resumes_to_the_uninterrupted_weights(tiny_run, tmp_path):
    """`blockdraft train --save-every 1`, SIGKILLed six times (three at random moments of
    training, three at a random file operation: while the feature cache, the run's config and the
    checkpoints and drafter are written), each time resumed with --resume, ends with the weights
    and optimizer state of an uninterrupted run, bit for bit; no resume went back more than the
    one step whose save was cut."""
    rng = random.Random(49)
    errors = tmp_path / "stderr.txt"
    whole = _run(_train_command(tiny_run, tiny_run / "data", tmp_path / "whole"), errors)
    assert whole.wait(timeout=300) == 0, errors.read_text()[-3000:]
    data, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(tiny_run / "data", data, ignore=shutil.ignore_patterns("features-*"))  # its cache built here
    # each kill costs at most ~8 of the 60 steps, so that all six land before the run ends
    plan = [("operation", rng.randint(1, 8)), ("moment", rng.randint(1, 8)), ("operation", rng.randint(9, 60)),
            ("moment", rng.randint(1, 8)), ("operation", rng.randint(9, 60)), ("moment", rng.randint(1, 8))]
    kills = 0
    for kind, k in plan:
        before = _logged_steps(out)
        if kind == "operation":  # the k-th file operation under tmp_path
            proc = _run(_train_command(tiny_run, data, out), errors, tmp_path, k)
        else:  # a moment in the k-th step from now
            proc = _run(_train_command(tiny_run, data, out), errors)
            _kill_while_training(proc, out, k, rng.uniform(0.0, 0.03))
        assert proc.wait(timeout=300) in (0, -signal.SIGKILL), errors.read_text()[-3000:]
        after = _logged_steps(out)[len(before):]
        if before and after:
            assert after[0] >= before[-1], f"{kind} kill: resumed at step {after[0]} after step {before[-1]}"
        kills += proc.returncode == -signal.SIGKILL
    proc = _run(_train_command(tiny_run, data, out), errors)  # the steps left after the last kill
    assert proc.wait(timeout=300) == 0, errors.read_text()[-3000:]
    assert kills == len(plan)
    assert max(_logged_steps(out)) == STEPS
    _assert_equal_tensors(load_file(str(out / "drafter" / "model.safetensors")),
                          load_file(str(tmp_path / "whole" / "drafter" / "model.safetensors")))
    _assert_equal_tensors(_state_tensors(out), _state_tensors(tmp_path / "whole"))
    assert not list(out.rglob(".*")), "a temp file or directory was left behind"
