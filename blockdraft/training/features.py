"""Target features for training: the tapped hidden states of every training sequence.

Computed once by a prefill pass (no generation, no grad) and cached on disk as one fp16 matrix
[total tokens, K*H], memory-mapped, plus an index of where each sample starts. Building is
resumable: `progress.json` records how many samples are complete, and a restart continues there.
The trainer can also compute features online (`OnlineFeatures`) with the same interface.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import BlockdraftError


def _tap_tag(tap_ids: list[int]) -> str:
    return "taps-" + "-".join(str(i) for i in tap_ids)


def feature_dir(data_dir: str | os.PathLike, split: str, tap_ids: list[int]) -> Path:
    return Path(data_dir) / f"features-{split}-{_tap_tag(tap_ids)}"


class Features:
    """`get(i)` -> fp32 tensor [S_i, K*H] of sample i; `get_many` -> those of several samples."""

    def get(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    def get_many(self, indices: list[int], max_len: int | None = None) -> list[torch.Tensor]:
        return [self.get(i)[:max_len] for i in indices]


class CachedFeatures(Features):
    """Read side of the cache: `get(i)` -> fp32 tensor [S_i, K*H] of sample i."""

    def __init__(self, directory: Path, dtype=np.float16, filename: str = "features.f16"):
        meta = json.loads((directory / "index.json").read_text())
        self.offsets = meta["offsets"]  # len n + 1
        self.width = meta["width"]
        prog = json.loads((directory / "progress.json").read_text())
        if prog["done"] < len(self.offsets) - 1:
            raise BlockdraftError(f"feature cache {directory} is incomplete ({prog['done']} samples); rebuild it")
        self.array = np.memmap(directory / filename, dtype=dtype, mode="r",
                               shape=(self.offsets[-1], self.width))

    def get(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.array[self.offsets[i] : self.offsets[i + 1]], dtype=np.float32))


class SlicedFeatures(Features):
    """Some tap layers' columns of a cache built for more of them (the taps study reads the
    five-tap cache's columns instead of computing three- and one-tap caches)."""

    def __init__(self, cache: CachedFeatures, columns: torch.Tensor):
        self.cache, self.columns = cache, columns

    def get(self, i: int) -> torch.Tensor:
        return self.cache.get(i)[:, self.columns]


def sliced_cache(data_dir, split: str, samples: list[dict], tap_ids: list[int], hidden: int):
    """A complete cache of exactly these samples whose taps include `tap_ids` (the exact one
    first), as features of `tap_ids` only; None if there is none."""
    ids = [s["id"] for s in samples]
    exact = feature_dir(data_dir, split, tap_ids).name
    for directory in sorted(Path(data_dir).glob(f"features-{split}-taps-*"), key=lambda d: d.name != exact):
        try:
            have = [int(t) for t in directory.name.split("taps-", 1)[1].split("-")]
        except ValueError:
            continue
        if not set(tap_ids) <= set(have) or not (directory / "progress.json").exists():
            continue
        meta = json.loads((directory / "index.json").read_text())
        if meta["ids"] != ids or json.loads((directory / "progress.json").read_text())["done"] != len(ids):
            continue
        cache = CachedFeatures(directory)
        if have == list(tap_ids):
            return cache
        cols = torch.cat([torch.arange(have.index(t) * hidden, (have.index(t) + 1) * hidden) for t in tap_ids])
        return SlicedFeatures(cache, cols)
    return None


class EmbeddingFeatures(Features):
    """The "no target context" ablation's features: the target's embedding of each token."""

    def __init__(self, target, samples: list[dict]):
        self.target, self.samples = target, samples

    def get(self, i: int) -> torch.Tensor:
        ids = torch.tensor(self.samples[i]["input_ids"], device=self.target.device)
        with torch.no_grad():
            return self.target.embed_tokens(ids).float().cpu()


class OnlineFeatures(Features):
    """Features computed on demand by a target forward (no cache on disk)."""

    def __init__(self, target, samples: list[dict], tap_ids: list[int]):
        self.target, self.samples, self.tap_ids = target, samples, tap_ids

    def get(self, i: int) -> torch.Tensor:
        ids = torch.tensor([self.samples[i]["input_ids"]], device=self.target.device)
        out = self.target.forward(ids, self.target.new_cache(), self.tap_ids, logits_at=1)
        return out.taps[0].float().cpu()

    @torch.no_grad()
    def get_many(self, indices: list[int], max_len: int | None = None) -> list[torch.Tensor]:
        """One right-padded target forward for all of them (`padded_forward`), kept on the target's
        device: on a GPU the per-sample forwards and the round trip through host memory would cost
        more than the drafter's step."""
        seqs = [self.samples[i]["input_ids"][:max_len] for i in indices]
        out = padded_forward(self.target, seqs, self.tap_ids, logits_at=1)
        return [row[: len(q)].float() for row, q in zip(out.taps, seqs)]  # each [S_i, K*H]


@dataclass
class Prefill:
    predictions: list[list[int]] | None  # the target's greedy next token at every position
    taps: list[np.ndarray] | None  # fp16 [S, K*H] per sequence


def padded_forward(target, seqs: list[list[int]], tap_ids: list[int] | None, logits_at: int | None,
                   pad_id: int = 0):
    """One target forward over several sequences, right-padded. Right padding needs no attention
    mask: causal attention never looks at the pads after a sequence, so each row equals the
    sequence alone (up to its length)."""
    ids = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)  # [n, S]
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    return target.forward(ids.to(target.device), target.new_cache(), tap_ids, logits_at=logits_at)


def prefill(target, seqs: list[list[int]], tap_ids: list[int] | None = None, predictions: bool = False,
            chunk: int = 8, pad_id: int = 0) -> Prefill:
    """One target forward over each sequence, a few at a time (full logits are [n, S, V])."""
    preds, taps = [], []
    for lo in range(0, len(seqs), chunk):
        group = seqs[lo : lo + chunk]
        out = padded_forward(target, group, tap_ids, None if predictions else 1, pad_id)
        if predictions:
            preds += [row[: len(s)].tolist() for row, s in zip(out.logits.argmax(-1).cpu(), group)]  # [n, S]
        if tap_ids:
            taps += [row[: len(s)].float().cpu().numpy().astype(np.float16) for row, s in zip(out.taps, group)]
    return Prefill(preds if predictions else None, taps if tap_ids else None)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)  # atomic: a kill leaves the old file or the new one, never half of one


def _open_for(directory: Path, ids: list[str], lengths: list[int], width: int, dtype=np.float16,
              filename: str = "features.f16") -> tuple[np.memmap, list[int], int]:
    """Open (or create, or grow) the cache of samples `ids` for writing: (array, offsets, done).

    A cache built for fewer samples grows when its samples are the first of these (a data
    directory that has grown since); any other difference is refused."""
    directory.mkdir(parents=True, exist_ok=True)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(int).tolist()
    index = {"offsets": offsets, "width": width, "ids": ids}
    index_path, prog_path = directory / "index.json", directory / "progress.json"
    done = 0
    if index_path.exists():
        old = json.loads(index_path.read_text())
        n = len(old["ids"])
        if old["width"] != width or old["ids"] != ids[:n] or old["offsets"] != offsets[: n + 1]:
            raise BlockdraftError(f"{directory} was built from other samples; delete it to rebuild")
        done = json.loads(prog_path.read_text())["done"] if prog_path.exists() else 0
    _write_json(index_path, index)
    path = directory / filename
    size = np.dtype(dtype).itemsize * max(offsets[-1], 1) * width
    with open(path, "ab") as f:  # create, and grow to the new size (a kill may have left it longer)
        f.truncate(size)
    return np.memmap(path, dtype=dtype, mode="r+", shape=(max(offsets[-1], 1), width)), offsets, done


def build_feature_cache(
    data_dir: str | os.PathLike, split: str, samples: list[dict], target, tap_ids: list[int],
    progress: bool = True, chunk: int = 8,
) -> CachedFeatures:
    """Write (or finish writing) the fp16 feature cache of `samples`; return its reader."""
    return build_cache(feature_dir(data_dir, split, tap_ids), samples, len(tap_ids) * target.hidden_size,
                       lambda seqs: prefill(target, seqs, tap_ids, chunk=chunk).taps, f"features ({split})",
                       progress, chunk)


def build_cache(directory: Path, samples: list[dict], width: int, rows_of, desc: str, progress: bool = True,
                chunk: int = 8, dtype=np.float16, filename: str = "features.f16") -> CachedFeatures:
    """A per-token cache of `samples` (resumable): rows_of(token id lists) -> one [S_i, width]
    array per sequence. The target features' cache, and the soft labels' (soft_labels.py)."""
    from tqdm import tqdm

    array, offsets, done = _open_for(directory, [s["id"] for s in samples], [len(s["input_ids"]) for s in samples],
                                     width, dtype, filename)
    bar = tqdm(total=len(samples), initial=done, disable=not progress, desc=desc, unit="seq")
    for lo in range(done, len(samples), chunk):
        rows = rows_of([s["input_ids"] for s in samples[lo : lo + chunk]])
        for r, x in enumerate(rows):
            array[offsets[lo + r] : offsets[lo + r + 1]] = x
        array.flush()  # data first, then the progress marker that vouches for it
        _write_json(directory / "progress.json", {"done": lo + len(rows)})
        bar.update(len(rows))
    bar.close()
    if not (directory / "progress.json").exists():
        _write_json(directory / "progress.json", {"done": len(samples)})
    del array
    return CachedFeatures(directory, dtype, filename)


def append_features(data_dir: str | os.PathLike, split: str, tap_ids: list[int],
                    rows: list[tuple[str, np.ndarray]]) -> None:
    """Append samples' features (id, fp16 [S, K*H]) to a cache that is complete so far: how
    `blockdraft data --features` keeps one beside the samples it writes, from its own prefill."""
    directory = feature_dir(data_dir, split, tap_ids)
    width = rows[0][1].shape[1]
    ids, lengths = [], []
    if (directory / "index.json").exists():
        old = json.loads((directory / "index.json").read_text())
        ids, lengths = list(old["ids"]), np.diff(old["offsets"]).astype(int).tolist()
        done = json.loads((directory / "progress.json").read_text())["done"]
        if done != len(ids):
            raise BlockdraftError(f"{directory} is incomplete ({done} of {len(ids)}); build it before appending")
    start = len(ids)
    array, offsets, _ = _open_for(directory, ids + [i for i, _ in rows], lengths + [len(x) for _, x in rows], width)
    for k, (_, x) in enumerate(rows):
        array[offsets[start + k] : offsets[start + k + 1]] = x
    array.flush()
    _write_json(directory / "progress.json", {"done": start + len(rows)})
    del array


def tap_channel_scale(features, n: int = 64) -> torch.Tensor:
    """Per-channel RMS of the taps over (up to) n samples [K*H]. Target hidden states have a few
    outlier channels far larger than the rest; dividing by this scale evens them out, and the
    scale is folded into `fc` when the drafter is saved (the checkpoint stays standard)."""
    sums, count = None, 0
    for i in range(n):
        try:
            x = features.get(i)
        except IndexError:
            break
        if x.shape[0] == 0:
            break
        sq = x.double().pow(2).sum(0)
        sums = sq if sums is None else sums + sq
        count += x.shape[0]
    if sums is None:
        raise BlockdraftError("no features to compute the tap scale from")
    return (sums / count).sqrt().clamp_min(1e-3).float()
