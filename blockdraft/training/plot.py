"""Held-out tau and block-position-1 accuracy against training sequences seen, from runs'
log.jsonl files (their evaluation rows), as a PNG: `blockdraft plot-training LOG... --out PNG`.

With several logs, each run is a stage that started from the previous stage's drafter: the x axis
counts sequences across stages, and a dotted line marks where each stage starts (each stage scores
its own held-out split, so the curves join only roughly). `start` adds the point at 0 sequences
(e.g. the drafter a run was initialised from, scored by `blockdraft accuracy` on the same held-out
split); `bench` (`blockdraft tau --json` files with one drafter per stage, in stage order) adds each
stage's benchmark tau at the end of that stage's run.
"""

from __future__ import annotations

import itertools
import json

from ..errors import BlockdraftError


def _evals(log_path: str) -> tuple[list[float], list[float], list[float], int]:
    """(sequences seen, tau, acc@1) at each evaluation of one run, and the run's last sequence count."""
    try:
        rows = [json.loads(line) for line in open(log_path) if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        raise BlockdraftError(f"cannot read training log {log_path}: {err}") from err
    seen = {r["step"]: r["samples_seen"] for r in rows if "loss" in r}
    per_step = max((r["samples_seen"] / r["step"] for r in rows if "loss" in r), default=1)
    by_step = {r["step"]: r for r in rows if r.get("heldout_tau") is not None}  # last row per step
    evals = [by_step[s] for s in sorted(by_step)]
    x = [seen.get(r["step"], r["step"] * per_step) for r in evals]
    tau = [r["heldout_tau"] for r in evals]
    acc = [r["heldout_acc"][0] if r.get("heldout_acc") else float("nan") for r in evals]
    return x, tau, acc, max(seen.values(), default=0)


def plot_training(log_paths: list[str], out_path: str, start: tuple[float, float] | None = None,
         bench: list[str] = ()) -> None:
    try:
        import matplotlib
    except ImportError as err:
        raise BlockdraftError("plotting needs matplotlib (in the dev extra)") from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax2 = ax.twinx()
    offset = 0
    ends = []
    for i, path in enumerate(log_paths):
        x, tau, acc, last = _evals(path)
        x = [offset + v for v in x]
        if start and i == 0:
            x, tau, acc = [0] + x, [start[0]] + tau, [start[1]] + acc
        if i:
            ax.axvline(offset, color="#bbb", linestyle=":")
        ax.plot(x, tau, "o-", color="#1f5fbf", label="held-out tau (block 16, by replay)" if i == 0 else None)
        ax2.plot(x, acc, "s--", color="#888", label="held-out accuracy, block position 1" if i == 0 else None)
        offset += last
        ends.append(offset)
    styles = itertools.cycle(zip("^vD*", ["#2a9d3a", "#e07b00", "#9b59b6", "#c0392b"]))
    for path, (marker, color) in zip(bench, styles):  # every file plotted; styles repeat after 4
        result = json.load(open(path))
        taus = [d["tau"] for d in result["drafters"].values()]
        if len(taus) != len(ends):
            raise BlockdraftError(f"{path}: {len(taus)} drafters for {len(ends)} stages")
        ax.plot(ends, taus, marker + "-", color=color, label=f"{result['dataset']}, {result['prompts']} prompts (end of stage)")
    ax.set_xlabel("training sequences seen" + (" (all stages)" if len(log_paths) > 1 else ""))
    ax.set_ylabel("tau")
    ax2.set_ylabel("accuracy at position 1")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)

