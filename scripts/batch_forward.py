"""One target forward over B sequences of one token each, in one slot cache (what a plain batch
step of `blockdraft serve` runs), with the rows' lengths ragged so that the forward has a mask:
milliseconds per forward (median of 12, after 2 uncounted), three ways:

- `transformers`: transformers' SDPA attention and cache layer as they are (K/V repeated per
  query-head group under a mask; the cache concatenated at every step);
- `shared heads`: K/V heads shared by the kernel (attention.share_kv_heads);
- `+ in place`: and the cache appended in place (cache.SlotLayer), what the engine runs.

Usage: python scripts/batch_forward.py [1,8,16] [PROMPT_TOKENS]   (SmolLM2, fp32, 2 threads)
"""

import sys
import time

import torch
from transformers.cache_utils import DynamicLayer

from blockdraft.decoding.slots import RowBlock, SlotCache
from blockdraft.ops.attention import SHARED_KV_ATTENTION
from blockdraft.models.target import load_target


@torch.inference_mode()
def forward_ms(target, rows: int, prompt: int, in_place: bool, reps: int = 12) -> float:
    slots = SlotCache()
    gen = torch.Generator().manual_seed(0)
    for r in range(rows):
        cache = target.new_cache()
        ids = torch.randint(100, 1000, (1, prompt + 3 * r), generator=gen)  # ragged: the forward has a mask
        target.forward(ids, cache, logits_at=1)
        target.rollback(cache, ids.shape[1])
        slots.join(cache)
    if not in_place:  # transformers' own layers again: concatenation
        for i, layer in enumerate(slots.kv.layers):
            slots.kv.layers[i] = DynamicLayer()
            slots.kv.layers[i].__dict__.update(layer.__dict__)
    blocks = [RowBlock([5]) for _ in range(rows)]
    times = []
    for i in range(reps + 2):
        t = time.perf_counter()
        out = slots.forward(target, blocks, None)
        for part in (out.sequences(1) if rows > 1 else [out]):
            part.rows(0, 1)  # the LM head on each sequence's row, as a verdict reads it
        slots.keep([[0]] * rows)
        times.append(time.perf_counter() - t)
    return sorted(times[2:])[reps // 2] * 1000


def main() -> None:
    sizes = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,8,16").split(",")]
    prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    target = load_target("smollm2-135m", "cpu")
    print(f"ms per forward, B sequences of one token after about {prompt} cached tokens each")
    print(f"{'B':>3} {'transformers':>13} {'shared heads':>13} {'+ in place':>11}")
    for b in sizes:
        target.model.set_attn_implementation("sdpa")
        plain = forward_ms(target, b, prompt, in_place=False)
        target.model.set_attn_implementation(SHARED_KV_ATTENTION)
        shared = forward_ms(target, b, prompt, in_place=False)
        both = forward_ms(target, b, prompt, in_place=True)
        print(f"{b:>3} {plain:>13.1f} {shared:>13.1f} {both:>11.1f}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
