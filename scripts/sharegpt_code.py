"""Write the ShareGPT records whose first answer holds a code block, leaving out those that data
directories already hold, as a JSONL (prompt and original answer) for
`blockdraft data --source OUT.jsonl --responses dataset`.

    python scripts/sharegpt_code.py OUT.jsonl [--exclude DATA_DIR ...] [--limit N]

Prompts over 1,000 characters are skipped (`blockdraft data` drops prompts over 256 tokens anyway).
"""

from __future__ import annotations

import argparse
import json

from blockdraft.data import iter_sharegpt, load_samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--exclude", nargs="*", default=[], help="data directories whose sample ids to leave out")
    ap.add_argument("--limit", type=int, default=3000)
    args = ap.parse_args()
    used = {r["id"] for d in args.exclude for r in load_samples(d, None)}
    n = seen = 0
    with open(args.out, "w") as f:
        for p in iter_sharegpt():
            if n >= args.limit:
                break
            seen += 1
            if p.id in used or not p.response or "```" not in p.response or len(p.messages[0]["content"]) > 1000:
                continue
            f.write(json.dumps({"id": p.id, "prompt": p.messages[0]["content"], "response": p.response}) + "\n")
            n += 1
    print(f"{args.out}: {n} records with code of {seen} read ({len(used)} excluded ids)")


if __name__ == "__main__":
    main()
