"""Markdown table of training runs at equal wall time: at the end, held-out accuracy at block
positions 1 and 2 over the full vocabulary (fixed anchors) and held-out tau; and the training
batches' loss and accuracy over the last 20% of logged steps (a sampled-softmax run's train
figures are over its sampled rows, so compare runs by the held-out columns).
    python scripts/summarize_runs.py runs/table/*"""

import json
import sys
from pathlib import Path


def summarize(run: Path) -> dict | None:
    log = run / "log.jsonl"
    if not log.exists():
        return None
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r]
    final = [r for r in rows if r.get("final")]
    if not train:
        return None
    tail = train[-max(1, len(train) // 5):]
    return {"run": run.name, "steps": train[-1]["step"], "minutes": train[-1]["elapsed"] / 60,
            "sequences": train[-1]["samples_seen"], "block_tok_s": sum(r["block_tokens_per_s"] for r in tail) / len(tail),
            "loss": sum(r["loss"] for r in tail) / len(tail), "acc1": sum(r["acc"][0] for r in tail) / len(tail),
            "tau": final[-1]["heldout_tau"] if final else None,
            "h_acc": final[-1].get("heldout_acc") if final else None}


def main(paths: list[str]) -> None:
    rows = [s for s in (summarize(Path(p)) for p in paths) if s]
    print("| run | minutes | steps | sequences | block tok/s | train loss | train acc@1 "
          "| held-out acc@1 | held-out acc@2 | held-out tau |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tau = f"{r['tau']:.3f}" if r["tau"] is not None else "-"
        h1, h2 = (f"{r['h_acc'][0]:.3f}", f"{r['h_acc'][1]:.3f}") if r["h_acc"] else ("-", "-")
        print(f"| {r['run']} | {r['minutes']:.1f} | {r['steps']} | {r['sequences']} | {r['block_tok_s']:.0f} "
              f"| {r['loss']:.3f} | {r['acc1']:.3f} | {h1} | {h2} | {tau} |")


if __name__ == "__main__":
    main(sys.argv[1:])
