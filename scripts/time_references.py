"""Time the greedy references `blockdraft tau` builds, batched in prompt order against sorted by length.

    python scripts/time_references.py --dataset mt-bench --limit 80 --max-new-tokens 128

In prompt order: one `reference_continuations` call per batch of 8 consecutive prompts (its batch is
then exactly those prompts, as before the sort). Sorted: one call over all prompts, which batches
prompts of similar length. Both run in this process, nothing cached, and must give the same tokens.
"""

import argparse
import time

from blockdraft.evaluation.datasets import load_prompts
from blockdraft.evaluation.replay import reference_continuations
from blockdraft.models.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    tgt = load_target(args.target)
    prompts = [tgt.encode_prompt(t, tgt.has_chat_template) for t in load_prompts(args.dataset, args.limit)]
    n, b = args.max_new_tokens, args.batch_size

    def in_prompt_order():
        return [ref for lo in range(0, len(prompts), b)
                for ref in reference_continuations(tgt, prompts[lo: lo + b], n, None, b, progress=False)]

    def sorted_by_length():
        return reference_continuations(tgt, prompts, n, None, b, progress=False)

    results, seconds = {}, {}
    for name, run in [("prompt order", in_prompt_order), ("sorted by length", sorted_by_length),
                      ("prompt order again", in_prompt_order)]:
        t0 = time.perf_counter()
        results[name] = run()
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: {seconds[name]:.1f} s", flush=True)
    base = min(seconds["prompt order"], seconds["prompt order again"])
    print(f"sorted / best prompt-order run: {seconds['sorted by length'] / base:.2f}x the time; "
          f"same references: {len({str(r) for r in results.values()}) == 1}")


if __name__ == "__main__":
    main()
