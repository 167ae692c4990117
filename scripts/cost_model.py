"""Print the bench's cost model (blockdraft.evaluation.bench.measure_costs) a few times on the first HumanEval
prompt: t(1), t_verify(B), t_draft and t(1) / (t_verify(B) + t_draft), the ceiling's factor.

    python scripts/cost_model.py [--block-size 16] [--runs 3] [--repeats 9]
"""

import argparse

from blockdraft.evaluation.bench import measure_costs
from blockdraft.evaluation.datasets import load_prompts
from blockdraft.cli import load_engine

parser = argparse.ArgumentParser()
parser.add_argument("--block-size", type=int, default=16)
parser.add_argument("--runs", type=int, default=3)
parser.add_argument("--repeats", type=int, default=9)
args = parser.parse_args()
engine = load_engine("smollm2-135m", None, "cpu")
target, draft, b = engine.target, engine.draft, args.block_size
prompt = target.encode_prompt(load_prompts("humaneval", 1)[0], True)
for _ in range(args.runs):
    c = measure_costs(target, draft, prompt, b, repeats=args.repeats)
    t = c["t_target"]
    print(f"t(1) {t[1] * 1e3:.1f} ms  t_verify({b}) {t[b] * 1e3:.1f} ms  t_draft {c['t_draft'] * 1e3:.1f} ms  "
          f"t(1) / (t_verify + t_draft) {t[1] / (t[b] + c['t_draft']):.3f}")
