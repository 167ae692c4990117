"""Write the prompts of the GPU run to gzipped JSONL shards that travel to a machine without the
package or a registry: ShareGPT first turns and the JSONL files given (e.g. `blockdraft prompts`
code prompts), mixed by the given shares, prompts only (the GPU run regenerates every response
with the target), one shard per data process there.

    python scripts/gpu/export_prompts.py OUT_DIR --shards 3 --chat 0.55 \\
        --jsonl runs/gpu/code.jsonl:0.35 --jsonl runs/gpu/sgcode.jsonl:0.10

Each shard interleaves the sources by their shares, so whatever part of it a time limit lets the
GPU finish has the same mix. Prompts over --max-chars characters are left out: `blockdraft data`
drops prompts over 256 tokens anyway, and they would only take room in the 64 MiB a call carries.
"""

import argparse
import gzip
import json
from pathlib import Path

from blockdraft.training.data import iter_jsonl, iter_sharegpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory for shard-K.jsonl.gz")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--chat", type=float, default=0.55, help="share of ShareGPT first turns")
    ap.add_argument("--jsonl", action="append", default=[], metavar="FILE:SHARE")
    ap.add_argument("--max-chars", type=int, default=1000)
    ap.add_argument("--limit", type=int, default=60000, help="prompts in all")
    args = ap.parse_args()

    sources = [("sharegpt", iter_sharegpt(), args.chat)]
    for spec in args.jsonl:
        path, share = spec.rsplit(":", 1)
        sources.append((Path(path).stem, iter_jsonl(path), float(share)))
    total = sum(s for _, _, s in sources)
    credit = {name: 0.0 for name, _, _ in sources}
    live = {name: it for name, it, _ in sources}
    counts = {name: 0 for name, _, _ in sources}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = [gzip.open(out / f"shard-{k}.jsonl.gz", "wt", encoding="utf-8") for k in range(args.shards)]
    n = 0
    while n < args.limit and live:
        for name, _, share in sources:  # deficit round robin: each source gets its share of the slots
            if name not in live:
                continue
            credit[name] += share / total
            while credit[name] >= 1 and name in live:
                p = next(live[name], None)
                if p is None:
                    del live[name]
                    break
                text = " ".join(m["content"] for m in p.messages)
                if len(text) > args.max_chars:
                    continue
                credit[name] -= 1
                files[n % args.shards].write(json.dumps({"id": f"{name}:{p.id}", "messages": p.messages}) + "\n")
                counts[name] += 1
                n += 1
    for f in files:
        f.close()
    print(f"{n} prompts in {args.shards} shards -> {out}: {counts}")


if __name__ == "__main__":
    main()
