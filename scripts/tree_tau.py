"""Tau of fixed-size token trees, the drafter alone (no lookup), greedy: trees shaped by the
drafter's confidence in each candidate (the engine's) against trees shaped by (depth, rank) rates
alone (before), at equal node budgets. Tau here depends on the verdicts only, not on timings, so
one run is the measure (docs/trees.md). With --calibration, also how well each predicts a
tried node's verdict (cross-fitted log-loss over the nodes of the largest budget's confidence run)
and the first candidate's acceptance by confidence bin.

    python scripts/tree_tau.py --dataset humaneval --limit 10 --budgets 4,6,8,16 --calibration
"""

import argparse
import math
from collections import defaultdict

from blockdraft.cli.common import load_engine
from blockdraft.decoding.engine import GenerationConfig
from blockdraft.decoding.policies import Policies
from blockdraft.decoding.tree import CONFIDENCE_EDGES, LOOKUP, TreeRates, confidence_key, tried_nodes
from blockdraft.evaluation.datasets import load_prompts


class LoggedRates(TreeRates):
    """TreeRates that also keep every tried drafter node: (depth, rank, confidence, accepted)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.nodes: list[tuple[int, int, float, bool]] = []

    def update(self, tree, path):
        for i, accepted in tried_nodes(tree, path):
            d, r = tree.depths[i], tree.ranks[i]
            if r != LOOKUP:
                self.nodes.append((d, r, tree.confidence[d - 1][r], accepted))
        super().update(tree, path)


def log_loss(nodes, key) -> float:
    """Two-fold cross-fitted log-loss of per-key acceptance rates (add-one smoothed)."""
    total = 0.0
    for fold in (0, 1):
        counts = defaultdict(lambda: [0, 0])
        for i, (d, r, c, a) in enumerate(nodes):
            if i % 2 != fold:
                counts[key(d, r, c)][0] += a
                counts[key(d, r, c)][1] += 1
        for i, (d, r, c, a) in enumerate(nodes):
            if i % 2 == fold:
                s, n = counts[key(d, r, c)]
                p = (s + 1) / (n + 2)
                total -= math.log(p if a else 1 - p)
    return total / len(nodes)


def calibration(nodes) -> None:
    print(f"\n{len(nodes)} tried nodes; cross-fitted log-loss of a node's verdict:")
    print(f"  by (depth, rank):            {log_loss(nodes, lambda d, r, c: (d, r)):.3f}")
    print(f"  by (depth, confidence bin):  {log_loss(nodes, lambda d, r, c: confidence_key(d, c)):.3f}")
    bins = defaultdict(lambda: [0, 0])
    for d, r, c, a in nodes:
        if r == 0:
            bins[confidence_key(1, c)[2]][0] += a
            bins[confidence_key(1, c)[2]][1] += 1
    edges = (0.0,) + CONFIDENCE_EDGES + (1.0,)
    print("first candidates by confidence: nodes, accepted share")
    for b, (s, n) in sorted(bins.items()):
        print(f"  {edges[b]:.2f}-{edges[b + 1]:.2f}  {n:5d}  {s / n:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--budgets", default="4,6,8,16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--calibration", action="store_true")
    args = ap.parse_args()
    engine = load_engine("smollm2-135m", None)
    target = engine.target
    prompts = [target.encode_prompt(t, target.has_chat_template) for t in load_prompts(args.dataset, args.limit)]
    print(f"{args.dataset} first {len(prompts)}, block {args.block_size}, {args.max_new_tokens} new tokens")
    print("nodes  tau by rank  tau by confidence")
    for budget in map(int, args.budgets.split(",")):
        taus = []
        for by_confidence in (False, True):
            engine.policies = Policies()  # each row learns its rates from scratch, as a fresh engine would
            rates = engine.policies.tree_rates["greedy"] = LoggedRates(by_confidence=by_confidence)
            accepted = steps = 0
            for ids in prompts:
                cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size, lookup=False,
                                       tree_budget=budget)
                lengths = engine.generate(ids, cfg).stats.acceptance_lengths
                accepted, steps = accepted + sum(lengths), steps + len(lengths)
            taus.append(accepted / steps)
        print(f"{budget:5d}  {taus[0]:11.3f}  {taus[1]:17.3f}", flush=True)
    if args.calibration:
        calibration(rates.nodes)


if __name__ == "__main__":
    main()
