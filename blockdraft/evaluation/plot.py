"""`blockdraft bench --plot`: speedup bars, acceptance histograms, speed against tau for several
oracles, and tau and speed against the verify size for chains and trees of fixed sizes."""

from __future__ import annotations

from ..errors import BlockdraftError


def verify_sizes(report: dict) -> dict:
    """Methods of a fixed verify size: {"chain": [(size, method)], "tree": [...]}, by size."""
    out = {"chain": [], "tree": []}
    for m, r in report["methods"].items():
        if not isinstance(r.get("block_size"), int) or r.get("lookup_steps"):
            continue
        tree = r.get("tree_budget")
        if tree is None:
            out["chain"].append((r["block_size"], m))
        elif isinstance(tree, int):
            out["tree"].append((tree, m))
    return {k: sorted(v) for k, v in out.items()}


def plot_report(report: dict, path: str) -> None:
    """Speedup bars, acceptance histograms, and (with several oracles) speedup against tau."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise BlockdraftError("--plot needs matplotlib (pip install 'blockdraft[bench]')") from err
    methods = report["methods"]
    oracles = [m for m in methods if m.startswith("oracle") and methods[m]["tau"]]
    sizes = verify_sizes(report)
    by_size = bool(sizes["tree"]) and len(sizes["chain"]) + len(sizes["tree"]) >= 3
    panels = 2 + (len(oracles) >= 2) + by_size
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    names = list(methods)
    base = "ar" if all(methods[m].get("speedup_vs_ar") for m in names) else "hf"
    bars = [methods[m].get(f"speedup_vs_{base}") or 0 for m in names]
    axes[0].bar(names, bars, color=["#3b7dd8" if m.startswith("dflash") else "#999999" for m in names])
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].set_ylabel(f"speedup over {base} (end-to-end tokens/s)")
    axes[0].set_title(f"{report.get('dataset', '')}, {report['prompts']} prompts, {report['max_new_tokens']} tokens")
    axes[0].tick_params(axis="x", rotation=30)
    for m in names:
        hist = methods[m]["acceptance_histogram"]
        if max(hist[1:], default=0):  # only methods where some step accepted a draft
            axes[1].plot(range(1, len(hist) + 1), [h / sum(hist) for h in hist], marker="o", ms=3,
                         label=f"{m} (tau {methods[m]['tau']})")
    axes[1].set_xlabel("acceptance length (tokens per step)")
    axes[1].set_ylabel("fraction of steps")
    axes[1].set_title("acceptance histogram")
    if axes[1].lines:
        axes[1].legend(fontsize=8)
    else:
        axes[1].text(0.5, 0.5, "no method accepted drafts", ha="center", transform=axes[1].transAxes)
    if len(oracles) >= 2:
        pts = sorted((methods[m]["tau"], methods[m].get("speedup_vs_ar"), methods[m].get("ceiling_speedup_vs_ar"))
                     for m in oracles)
        axes[2].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="measured")
        axes[2].plot([p[0] for p in pts], [p[2] for p in pts], ls="--",
                     label="cost-model ceiling at each oracle's block")
        axes[2].axhline(1.0, color="black", lw=0.8)
        axes[2].set_xlabel("tau (oracle drafter)")
        axes[2].set_ylabel("speedup over ar")
        axes[2].set_title("engine speed against tau")
        axes[2].legend(fontsize=8)
    if by_size:  # tau (solid) and speed over ar (dashed) against the tokens each step verifies
        ax, speed = axes[-1], axes[-1].twinx()
        for kind, color in (("chain", "#999999"), ("tree", "#3b7dd8")):
            pts = sizes[kind]
            if pts:
                xs = [n for n, _ in pts]
                ax.plot(xs, [methods[m]["tau"] for _, m in pts], marker="o", color=color, label=f"{kind}: tau")
                speed.plot(xs, [methods[m].get("speedup_vs_ar") or 0 for _, m in pts], marker="s", ls="--",
                           color=color, label=f"{kind}: speed vs ar")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens verified per step (block, or tree nodes)")
        ax.set_ylabel("tau (solid)")
        speed.set_ylabel("speedup over ar (dashed)")
        speed.axhline(1.0, color="black", lw=0.8)
        ax.set_title("chain against tree by verify size")
        lines = ax.get_legend_handles_labels()
        more = speed.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
