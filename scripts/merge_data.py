"""Merge `blockdraft data` directories into one that `blockdraft train --labels target` reads.

    python scripts/merge_data.py OUT SRC [SRC ...]

- Every sample gets `target_next` (the label for `--labels target`): data made with
  `--responses dataset` stores the target's predictions; in data made with `--responses target`
  the responses are the target's own greedy tokens, so the next token is that prediction.
- Ids become "<source dir name>/<id>" (the same prompt may be in two sources).
- Held-out samples come only from sources whose responses are the target's own (what a drafter
  meets at inference); with none of those, from all sources.
- Train features already cached in a source (`blockdraft train` builds them) are copied, not
  recomputed: the merged cache starts complete up to the first sample that has none, and
  `blockdraft train` computes the rest (resumable, as always).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from blockdraft.data import load_samples


def main(out: str, sources: list[str]) -> None:
    out_dir = Path(out)
    if (out_dir / "samples.jsonl").exists():
        sys.exit(f"{out_dir} already holds data; use a new directory")
    settings = [json.loads((Path(s) / "manifest.json").read_text())["settings"] for s in sources]
    own = [st["responses"] == "target" for st in settings]
    heldout_from = own if any(own) else [True] * len(sources)
    train, heldout, cached = [], [], []  # cached: (source, feature dir, index in source) per train sample
    for src, st, use_heldout in zip(sources, settings, heldout_from):
        name = Path(src).name
        rows = load_samples(src, None)
        caches = sorted(Path(src).glob("features-train-taps-*"))
        idx = json.loads((caches[0] / "index.json").read_text()) if caches else {"ids": []}
        done = json.loads((caches[0] / "progress.json").read_text())["done"] if caches else 0
        position = {sid: i for i, sid in enumerate(idx["ids"][:done])}
        for r in rows:
            if "target_next" not in r:
                if st["responses"] != "target":
                    sys.exit(f"{src}: sample {r['id']} has no target predictions (made before they were stored?)")
                r["target_next"] = r["input_ids"][1:] + [r["input_ids"][-1]]
            r["id"] = f"{name}/{r['id']}"
            if r["split"] == "heldout":
                if use_heldout:
                    heldout.append(r)
            else:
                sid = r["id"].split("/", 1)[1]
                train.append(r)
                cached.append((caches[0], position[sid]) if sid in position else None)
    # samples with cached features first, so that the copied prefix is as long as possible
    order = sorted(range(len(train)), key=lambda i: cached[i] is None)
    train, cached = [train[i] for i in order], [cached[i] for i in order]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "samples.jsonl", "w") as f:
        for r in train + heldout:
            f.write(json.dumps(r) + "\n")
    (out_dir / "manifest.json").write_text(json.dumps(
        {"settings": {"merged_from": [str(s) for s in sources], "sources": settings}, "format": 1}, indent=2) + "\n")

    n_cached = next((i for i, c in enumerate(cached) if c is None), len(cached))
    if n_cached:
        tag = cached[0][0].name  # features-train-taps-...
        dest = out_dir / tag
        dest.mkdir()
        offsets = np.concatenate([[0], np.cumsum([len(r["input_ids"]) for r in train])]).tolist()
        width = json.loads((cached[0][0] / "index.json").read_text())["width"]
        arr = np.memmap(dest / "features.f16", dtype=np.float16, mode="w+", shape=(offsets[-1], width))
        readers: dict = {}
        for i in range(n_cached):
            cdir, j = cached[i]
            if cdir not in readers:
                meta = json.loads((cdir / "index.json").read_text())
                readers[cdir] = (meta["offsets"], np.memmap(cdir / "features.f16", dtype=np.float16, mode="r",
                                                            shape=(meta["offsets"][-1], meta["width"])))
            src_off, src = readers[cdir]
            arr[offsets[i] : offsets[i + 1]] = src[src_off[j] : src_off[j + 1]]
        arr.flush()
        (dest / "index.json").write_text(json.dumps({"offsets": offsets, "width": width, "ids": [r["id"] for r in train]}))
        (dest / "progress.json").write_text(json.dumps({"done": n_cached}))
    print(f"{out_dir}: {len(train)} train ({n_cached} with copied features), {len(heldout)} held out; "
          f"{sum(sum(r['loss_mask']) for r in train)} train response tokens")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
