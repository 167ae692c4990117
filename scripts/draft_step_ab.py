"""The bundled drafter's decode step (draft forward, head, greedy tokens, as the engine runs it) in
this working tree against the drafter code of an earlier git revision, alternating in one
process, with the CPU's caches evicted before each call as a decode step finds them (the target's
forward streams its weights between two draft steps). Both drafters carry the same weights and
must propose the same tokens.

    python scripts/draft_step_ab.py --rev 3a30f1d --blocks 2,3,4

Needs git and the revision in this checkout. Prints the median and lower quartile, in ms.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def old_draft_module(rev: str):
    """blockdraft/models/draft.py as it was at `rev`, imported beside today's package (its relative
    imports resolved against today's blockdraft.models)."""
    source = subprocess.run(["git", "show", f"{rev}:blockdraft/models/draft.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "draft_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("blockdraft.models._draft_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", required=True, help="the git revision whose drafter code to compare with")
    parser.add_argument("--blocks", default="2,3,4")
    parser.add_argument("--draft-dtype", default="bfloat16", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()

    from blockdraft.cli.common import bundled_drafter
    from blockdraft.decoding.engine import Engine
    from blockdraft.models.checkpoint import load_draft
    from blockdraft.models.draft import DraftCache
    from blockdraft.lab.profiling import evict_caches
    from blockdraft.models.target import load_target

    old = old_draft_module(args.rev)
    target = load_target("smollm2-135m")
    now = load_draft(bundled_drafter("smollm2-135m"))
    then = old.DraftModel(now.cfg).eval()
    then.load_state_dict(now.state_dict())
    then.vocab_ids = now.vocab_ids
    dtype = getattr(torch, args.draft_dtype)
    for draft in (now, then):
        Engine(target, draft, draft_dtype=dtype)
    ctx = list(range(100, 356))
    past = len(ctx) - 2  # two new context rows a step: a step that committed two tokens
    blocks = [int(b) for b in args.blocks.split(",")]
    with torch.inference_mode():
        taps = target.forward(torch.tensor([ctx]), target.new_cache(), now.cfg.target_layer_ids).taps
        embed = target.embed_tokens

        def stepper(draft, cache_type):
            cache, head = cache_type(len(draft.layers)), draft.head_for(target.lm_head)
            draft.block_hidden(embed, cache, taps[:, :past], 0, past, 16)  # the context's K/V

            def step(block):
                if hasattr(draft, "block_top"):  # greedy proposals as the engine takes them
                    tokens = draft.block_top(embed, head, cache, taps[:, past:], 0, len(ctx), block, 1)[:, 0]
                else:
                    tokens = head(draft.block_hidden(embed, cache, taps[:, past:], 0, len(ctx), block)).argmax(-1)
                cache.length = past  # the same two new rows at the next call
                return tokens
            return step

        steps = {"this tree": stepper(now, DraftCache), args.rev: stepper(then, old.DraftCache)}
        print(f"draft step, ms, cold caches ({now.precision}): median (lower quartile)")
        print(f"{'block':<12}" + "".join(f"{name:>22}" for name in steps))
        for block in blocks:
            first = [step(block) for step in steps.values()]
            if not torch.equal(first[0], first[1]):
                raise SystemExit(f"block {block}: the two drafters propose different tokens")
            seconds: dict = {name: [] for name in steps}
            for _ in range(args.rounds):
                for name, step in steps.items():
                    for _ in range(15):
                        evict_caches()
                        t0 = time.perf_counter()
                        step(block)
                        seconds[name].append(time.perf_counter() - t0)
            cells = []
            for s in seconds.values():
                s.sort()
                cells.append(f"{1e3 * s[len(s) // 2]:.2f} ({1e3 * s[len(s) // 4]:.2f})")
            print(f"{block:<12}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
