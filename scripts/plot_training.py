"""Held-out tau and block-position-1 accuracy against training sequences seen, from a run's
log.jsonl (its evaluation rows), as a PNG (matplotlib, in the dev extra):

    python scripts/plot_training.py runs/drafter/log.jsonl docs/drafter-tau.png [--start TAU ACC1]

--start adds the point at 0 sequences (e.g. the drafter a run was initialised from, scored by
scripts/heldout_accuracy.py on the same held-out split)."""

import json
import sys


def main(log_path: str, out_path: str, start: tuple[float, float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(log_path)]
    seen = {r["step"]: r["samples_seen"] for r in rows if "loss" in r}
    evals = [r for r in rows if r.get("heldout_tau") is not None]
    per_step = max((r["samples_seen"] / r["step"] for r in rows if "loss" in r), default=1)
    x = [seen.get(r["step"], r["step"] * per_step) for r in evals]
    tau = [r["heldout_tau"] for r in evals]
    acc = [r["heldout_acc"][0] if r.get("heldout_acc") else float("nan") for r in evals]
    if start:
        x, tau, acc = [0] + x, [start[0]] + tau, [start[1]] + acc
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, tau, "o-", color="#1f5fbf", label="held-out tau (block 16, by replay)")
    ax.set_xlabel("training sequences seen")
    ax.set_ylabel("tau")
    ax2 = ax.twinx()
    ax2.plot(x, acc, "s--", color="#888", label="held-out accuracy, block position 1")
    ax2.set_ylabel("accuracy at position 1")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="lower right")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


if __name__ == "__main__":
    args = sys.argv[1:]
    start = None
    if "--start" in args:
        i = args.index("--start")
        start = (float(args[i + 1]), float(args[i + 2]))
        args = args[:i] + args[i + 3:]
    if len(args) != 2:
        sys.exit(__doc__)
    main(args[0], args[1], start)
