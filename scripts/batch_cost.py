"""Decode steps of several sequences at once through `engine.batch()`, no server: tokens/s and
where a step's time goes, per batch size (SmolLM2 with the bundled drafter, greedy, 64 new
tokens of MT-Bench questions).

Usage: python scripts/batch_cost.py [DRAFT|default|none] [1,2,4,8] [BLOCKS] [--draft-each]
  BLOCKS: fixed blocks to compare, comma-separated, lookup off (e.g. 1,2,4; default: the shipped
  adaptive setting); --draft-each: one draft forward per sequence, as before batched drafting."""

import sys
import time

import torch

import blockdraft.decoding.engine as engine_module
from blockdraft.evaluation.datasets import load_prompts
from blockdraft.cli import load_engine
from blockdraft.decoding.engine import GenerationConfig, GenerationStats


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    draft = args[0] if args else "default"
    sizes = [int(x) for x in (args[1] if len(args) > 1 else "1,2,4,8").split(",")]
    blocks = [int(x) for x in args[2].split(",")] if len(args) > 2 else [None]
    if "--draft-each" in sys.argv:
        batched = engine_module.draft_blocks
        engine_module.draft_blocks = lambda wanted, target, d: [batched([w], target, d)[0] for w in wanted]
    engine = load_engine("smollm2-135m", None if draft == "default" else draft, "cpu")
    prompts = [engine.target.encode_prompt(t, True) for t in load_prompts("mt-bench", max(sizes))]
    engine.generate(prompts[0], GenerationConfig(max_new_tokens=16))  # warm-up
    for block in blocks:
        cfg = GenerationConfig(max_new_tokens=64) if block is None else \
            GenerationConfig(max_new_tokens=64, block_size=block, lookup=False)
        for b in sizes:
            batch = engine.batch()
            seqs = [batch.join(p, cfg, GenerationStats())[0] for p in prompts[:b]]
            t0, steps, tokens = time.perf_counter(), 0, 0
            while batch.sequences:
                tokens += sum(len(st.tokens) for _, st in batch.step())
                steps += 1
            seconds = time.perf_counter() - t0
            phases = {k: round(sum(s.stats.step_seconds.as_dict()[k] for s in seqs) / b / steps * 1000, 1)
                      for k in seqs[0].stats.step_seconds.as_dict()}
            name = "adaptive" if block is None else f"block {block}"
            print(f"{name}, B={b}: {tokens / seconds:.1f} tok/s, {seconds / steps * 1000:.0f} ms/step, "
                  f"tau {sum(s.stats.tau for s in seqs) / b:.2f}, ms/step by phase {phases}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
