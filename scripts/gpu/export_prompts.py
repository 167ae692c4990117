"""Write ShareGPT first turns (with their ids, so `blockdraft data` splits them as on the CPU)
to a gzipped JSONL that travels to a machine without the package or a registry."""

import gzip
import json
import sys

from blockdraft.training.data import iter_sharegpt

out, limit = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40000
with gzip.open(out, "wt", encoding="utf-8") as f:
    for n, p in enumerate(iter_sharegpt()):
        if n >= limit:
            break
        f.write(json.dumps({"id": p.id, "messages": p.messages, "response": p.response}) + "\n")
print(f"{min(n, limit)} prompts -> {out}")
