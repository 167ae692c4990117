"""Merge `blockdraft data` directories into one that `blockdraft train --labels target` reads
(`blockdraft merge-data OUT SRC [SRC ...] [--cache-from EARLIER_MERGE ...]`).

- Every sample gets `target_next` (the label for `--labels target`): data made with
  `--responses dataset` stores the target's predictions; in data made with `--responses target`
  the responses are the target's own greedy tokens, so the next token is that prediction.
- Ids become "<source dir name>/<id>" (the same prompt may be in two sources).
- Held-out samples come only from sources whose responses are the target's own (what a drafter
  meets at inference); with none of those, from all sources.
- Train features already cached in a source (`blockdraft data --features` or `blockdraft train`
  builds them) are copied, not recomputed: the merged cache starts complete up to the first
  sample that has none, and `blockdraft train` computes the rest (resumable, as always).
- `--cache-from DIR` also copies features from an earlier merge of the same sources (its ids are
  the same "<source dir name>/<id>"), so growing one source does not recompute the others.
- The merge is written to OUT.partial and renamed to OUT when complete: an interrupted merge
  leaves no OUT that looks whole, and the next run starts it again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from ..errors import BlockdraftError
from .data import load_samples


def _completed_ids(cdir: Path) -> list[str]:
    """Ids of the samples whose features a cache directory holds complete (none if no cache)."""
    if not (cdir / "progress.json").exists():
        return []
    ids = json.loads((cdir / "index.json").read_text())["ids"]
    return ids[: json.loads((cdir / "progress.json").read_text())["done"]]


def _cached_rows(sources: list[str], tag: str, earlier: list[str] = ()) -> dict:
    """(source, merged id) -> (cache dir, row index) for train samples whose features are cached."""
    out = {}
    by_name = {Path(s).name: s for s in sources}
    for merged in earlier:  # an earlier merge's cache: its ids already name their source
        cdir = Path(merged) / tag
        for j, mid in enumerate(_completed_ids(cdir)):
            if mid.split("/")[0] in by_name:
                out[(by_name[mid.split("/")[0]], mid)] = (cdir, j)
    for src in sources:
        cdir = Path(src) / tag
        for j, sid in enumerate(_completed_ids(cdir)):
            out[(src, f"{Path(src).name}/{sid}")] = (cdir, j)
    return out


def _copy_features(dest: Path, train: list[dict], where: dict) -> int:
    """Write the merged cache's leading rows that the sources have; return how many."""
    n = 0
    while n < len(train) and (train[n]["source"], train[n]["id"]) in where:
        n += 1
    if n == 0:
        return 0
    dest.mkdir()
    offsets = np.concatenate([[0], np.cumsum([len(r["input_ids"]) for r in train])]).tolist()
    readers: dict = {}
    arr = None
    for i in range(n):
        cdir, j = where[(train[i]["source"], train[i]["id"])]
        if cdir not in readers:
            meta = json.loads((cdir / "index.json").read_text())
            readers[cdir] = (meta["offsets"], np.memmap(cdir / "features.f16", dtype=np.float16, mode="r",
                                                        shape=(meta["offsets"][-1], meta["width"])))
        src_off, src = readers[cdir]
        if arr is None:
            width = src.shape[1]
            arr = np.memmap(dest / "features.f16", dtype=np.float16, mode="w+", shape=(offsets[-1], width))
        arr[offsets[i] : offsets[i + 1]] = src[src_off[j] : src_off[j + 1]]
    arr.flush()
    (dest / "index.json").write_text(json.dumps({"offsets": offsets, "width": width, "ids": [r["id"] for r in train]}))
    (dest / "progress.json").write_text(json.dumps({"done": n}))
    return n


def merge_data(out: str, sources: list[str], earlier: list[str] = ()) -> str:
    """Write the merge of `sources` to `out`; return a one-line summary."""
    final = Path(out)
    if final.exists() and any(final.iterdir()):
        raise BlockdraftError(f"{final} already exists and is not empty; give a new directory")
    if not sources:
        raise BlockdraftError("give at least one source data directory")
    if len({Path(s).name for s in sources}) < len(sources):
        raise BlockdraftError("two sources have the same directory name (merged ids are '<dir name>/<id>')")
    for s in [*sources, *earlier]:
        if not (Path(s) / "manifest.json").is_file() or not (Path(s) / "samples.jsonl").is_file():
            raise BlockdraftError(f"{s} is not a `blockdraft data` directory (no manifest.json and samples.jsonl)")
    settings = [json.loads((Path(s) / "manifest.json").read_text())["settings"] for s in sources]
    out_dir = final.with_name(final.name + ".partial")
    shutil.rmtree(out_dir, ignore_errors=True)  # an interrupted earlier merge: start again
    own = [st["responses"] == "target" for st in settings]
    heldout_from = own if any(own) else [True] * len(sources)
    train, heldout = [], []
    for src, st, use_heldout in zip(sources, settings, heldout_from):
        name = Path(src).name
        for r in load_samples(src, None):
            if "target_next" not in r:
                if st["responses"] != "target":
                    raise BlockdraftError(f"{src}: sample {r['id']} has no target predictions (made before they were stored?)")
                r["target_next"] = r["input_ids"][1:] + [r["input_ids"][-1]]
            r["source"], r["id"] = src, f"{name}/{r['id']}"
            if r["split"] == "train":
                train.append(r)
            elif use_heldout:
                heldout.append(r)
    # one feature cache per tap set the first source has; samples with cached features go first
    tags = sorted(p.name for p in Path(sources[0]).glob("features-train-taps-*"))
    where = {tag: _cached_rows(sources, tag, earlier) for tag in tags}
    if tags:
        first = where[tags[0]]
        train.sort(key=lambda r: (r["source"], r["id"]) not in first)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "samples.jsonl", "w") as f:
        for r in train + heldout:
            f.write(json.dumps({k: v for k, v in r.items() if k != "source"}) + "\n")
    (out_dir / "manifest.json").write_text(json.dumps(
        {"settings": {"merged_from": [str(s) for s in sources], "sources": settings}, "format": 1}, indent=2) + "\n")
    n_cached = 0
    for tag in tags:
        n_cached = max(n_cached, _copy_features(out_dir / tag, train, where[tag]))
    if final.exists():
        final.rmdir()  # empty (checked above)
    out_dir.rename(final)
    return (f"{final}: {len(train)} train ({n_cached} with copied features), {len(heldout)} held out; "
            f"{sum(sum(r['loss_mask']) for r in train)} train response tokens")

