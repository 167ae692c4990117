"""The eager forward's own overhead: SmolLM2's depth (30 decoder layers) at hidden
size 64, where the matmuls cost almost nothing, timed like a decode step after a 256-token context.

    python scripts/forward_overhead.py
"""

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blockdraft.models.target import Target


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=30,
                      num_attention_heads=4, num_key_value_heads=2)
    target = Target(LlamaForCausalLM(cfg).float(), None)
    cache = target.new_cache()
    target.forward(torch.zeros(1, 256, dtype=torch.long), cache)
    for tokens in (1, 16):
        ids = torch.zeros(1, tokens, dtype=torch.long)
        times = []
        for _ in range(33):
            t0 = time.perf_counter()
            target.forward(ids, cache).logits
            target.rollback(cache, 256)
            times.append(time.perf_counter() - t0)
        print(f"30 layers, hidden 64, {tokens:2d} tokens: {1e3 * sorted(times[3:])[15]:.1f} ms per forward")


if __name__ == "__main__":
    main()
