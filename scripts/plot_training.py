"""Plot held-out tau (and block-position-1 accuracy) against training tokens from a run's
log.jsonl, as a dependency-free SVG:  python scripts/plot_training.py runs/drafter/log.jsonl out.svg"""

import json
import sys


def polyline(points, x_max, y_max, color, w=560, h=300, pad=50):
    coords = " ".join(f"{pad + x / x_max * w:.1f},{pad + h - y / y_max * h:.1f}" for x, y in points)
    return f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>'


def main(log_path: str, out_path: str) -> None:
    rows = [json.loads(line) for line in open(log_path)]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if r.get("heldout_tau") is not None]
    tokens_at = {r["step"]: r["samples_seen"] for r in train}
    # x axis: training samples seen (each holds `anchors` blocks of block_size tokens)
    tau = [(tokens_at.get(r["step"], 0), r["heldout_tau"]) for r in evals]
    # drawn on the tau scale, +1: held-out accuracy where the log has it, else the training batch's
    acc1 = [(tokens_at.get(r["step"], 0), 1 + r["heldout_acc"][0]) for r in evals if r.get("heldout_acc")]
    acc1 = acc1 or [(r["samples_seen"], 1 + r["acc"][0]) for r in train]
    x_max = max([x for x, _ in tau + acc1] + [1])
    y_max = max([y for _, y in tau + acc1] + [2.0]) * 1.1
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="660" height="400" font-family="sans-serif" font-size="12">',
             '<rect width="660" height="400" fill="white"/>',
             '<line x1="50" y1="350" x2="610" y2="350" stroke="black"/><line x1="50" y1="50" x2="50" y2="350" stroke="black"/>',
             f'<text x="330" y="385" text-anchor="middle">training sequences seen (max {x_max})</text>',
             f'<text x="55" y="45">y max {y_max:.2f}; blue: held-out tau; grey: 1 + accuracy at block position 1 (held out if logged)</text>']
    if acc1:
        parts.append(polyline(acc1, x_max, y_max, "#aaa"))
    if tau:
        parts.append(polyline(tau, x_max, y_max, "#1f5fbf"))
    parts.append("</svg>")
    open(out_path, "w").write("\n".join(parts))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
