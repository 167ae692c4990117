"""A training run's checkpoint on disk, kept whole under kills (SIGKILL, the OOM killer, a lost
machine): `--resume` either continues from the newest checkpoint or refuses with a reason, never
silently starts again at step 0.

Layout in the run directory (`--out`):

    state-00001200/        one directory per checkpoint, named by its step
        state.safetensors  the drafter's weights, the optimizer's moments, the tap scale
        trainer.json       step, elapsed seconds, the run's config, the optimizer's param groups,
                           and the byte size of state.safetensors

A checkpoint is written as `.state-00001200.tmp/`, every file fsynced, then renamed into place
(one rename of a complete directory: atomic on POSIX file systems) and the run directory fsynced.
That rename is the commit: a kill before it leaves the previous checkpoint as the newest, a kill
after it leaves the new one. Only then are older checkpoints removed, so there is always one whole.
Loading takes the `state-*` directory of the highest step.

Why no pointer file (`LATEST`, `state.json`): the directory's name already says its step, and the
rename that puts it in place is as atomic as replacing a pointer would be. A pointer would be a
second commit point, and a kill between the two could leave them disagreeing.

The layout before (issue 49) swapped `state/` in by two renames, through `state.old/`; a kill
between them left only `state.old`, which the old `--resume` did not look for. Both names are
still read (the higher step wins), and removed with the first new checkpoint. A `state.tmp/` of
that layout is never read: nothing vouches that it was written to the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BlockdraftError
from ..models.files import fsync_path

_NAME = re.compile(r"state-(\d+)")
LEGACY = ("state", "state.old")  # the layout before: the current checkpoint and the one it replaced


@dataclass
class TrainState:
    model: dict  # the drafter's state dict (whole tensors, also under FSDP)
    optimizer: dict  # torch's optimizer state dict: {"state": {index: {name: tensor}}, "param_groups": [...]}
    tap_scale: torch.Tensor | None
    step: int
    elapsed: float  # seconds trained (the time budget's clock)
    config: dict  # the TrainConfig the run was saved under (asdict, as JSON reads it back)


def state_dir(out: Path, step: int) -> Path:
    return out / f"state-{step:08d}"


def write_json_atomic(path: Path, obj) -> None:
    """Replace a small JSON file whole: a kill leaves the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    fsync_path(tmp)
    os.replace(tmp, path)


def save_state(out: Path, state: TrainState) -> Path:
    """Write the checkpoint of `state.step` (module docstring: write, fsync, one rename, then drop
    the older ones); its directory."""
    from safetensors.torch import save_file

    final = state_dir(out, state.step)
    if final.is_dir():
        # Committed already: the run resumed from this very checkpoint (the newest) and had no
        # step left to train, or a time budget ended it on a step it had saved.
        return final
    tmp = out / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a save a kill interrupted
    tmp.mkdir(parents=True)
    tensors = {f"draft.{k}": v.detach().cpu().contiguous() for k, v in state.model.items()}
    for idx, st in state.optimizer["state"].items():
        for k, v in st.items():
            tensors[f"opt.{idx}.{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
    if state.tap_scale is not None:
        tensors["tap_scale"] = state.tap_scale.detach().cpu().contiguous()
    save_file(tensors, str(tmp / "state.safetensors"))
    meta = {"step": state.step, "elapsed": state.elapsed, "config": state.config,
            "param_groups": state.optimizer["param_groups"],
            "files": {"state.safetensors": (tmp / "state.safetensors").stat().st_size}}
    (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
    for name in ("state.safetensors", "trainer.json"):
        fsync_path(tmp / name)
    fsync_path(tmp)
    os.rename(tmp, final)  # the commit
    fsync_path(out)
    for old in _candidates(out):  # superseded: the new checkpoint is whole and on the disk
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    for leftover in [*out.glob(".state-*.tmp"), out / "state.tmp"]:
        shutil.rmtree(leftover, ignore_errors=True)
    return final


def _candidates(out: Path) -> list[Path]:
    """Every checkpoint directory in `out`, new layout and old, in no particular order."""
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if p.is_dir() and _NAME.fullmatch(p.name)]
    return found + [out / n for n in LEGACY if (out / n).is_dir()]


def _step_of(path: Path) -> float:
    m = _NAME.fullmatch(path.name)
    if m:
        return int(m.group(1))
    try:  # the old layout's names carry no step
        return int(json.loads((path / "trainer.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return float("inf")  # unreadable: taken as the newest, so that loading it refuses, naming it


def latest_state(out: Path) -> Path | None:
    """The newest checkpoint directory of the run in `out`, or None if it holds none at all. Where
    the new layout has one, old-layout directories are leftovers of their removal (which follows
    the first new checkpoint), whole or not."""
    found = _candidates(out)
    new = [p for p in found if _NAME.fullmatch(p.name)]
    return max(new or found, key=_step_of) if found else None


def has_state(out: Path) -> bool:
    return bool(_candidates(out))


def load_state(path: Path) -> TrainState:
    """A checkpoint directory's contents; a damaged one is refused (never skipped silently: what
    resuming from an older one would lose is the user's call)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    others = sorted((p for p in _candidates(path.parent) if p != path), key=_step_of)
    hint = (f"; move it aside to resume from {others[-1].name}" if others else
            "; there is no other checkpoint: start again in a new --out")
    try:
        meta = json.loads((path / "trainer.json").read_text())
        size = (path / "state.safetensors").stat().st_size
        want = meta.get("files", {}).get("state.safetensors", size)  # the old layout did not record it
        if size != want:
            raise ValueError(f"state.safetensors has {size} bytes, trainer.json says {want}")
        tensors = load_file(str(path / "state.safetensors"))
        step, elapsed, groups = int(meta["step"]), float(meta["elapsed"]), meta["param_groups"]
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:
        raise BlockdraftError(f"checkpoint {path} is damaged ({err}){hint}") from err
    opt: dict = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, idx, name = k.split(".", 2)
            opt.setdefault(int(idx), {})[name] = v
    model = {k[len("draft."):]: v for k, v in tensors.items() if k.startswith("draft.")}
    return TrainState(model, {"state": opt, "param_groups": groups}, tensors.get("tap_scale"), step, elapsed,
                      meta.get("config") or {})


def config_changes(saved: dict, current: dict, may_change: frozenset[str], defaults: dict) -> list[str]:
    """The fields of `current` (a TrainConfig as JSON) that differ from the config a run was saved
    under, leaving out those that may change on resume. A field the saved config lacks (added to
    TrainConfig since) counts as its default. Paths count as equal when they name the same file."""
    changed = []
    for name, now in current.items():
        if name in may_change:
            continue
        before = saved.get(name, defaults.get(name))
        if before == now:
            continue
        if isinstance(before, str) and isinstance(now, str) and os.path.realpath(before) == os.path.realpath(now):
            continue  # "runs/data" then, "/abs/runs/data" now
        changed.append(f"{name} ({before!r} -> {now!r})")
    return changed
