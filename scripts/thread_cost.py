"""The cost of one SmolLM2 target forward (one token after 64, fp32, prepacked linears) in the
main thread and in a thread started later, which is why `blockdraft serve` runs its engine in
the main thread (docs/serving.md). Usage: python scripts/thread_cost.py"""

import threading
import time

import torch

from blockdraft.cli import load_engine


def forward_ms(target, repeats: int = 20) -> float:
    with torch.inference_mode():
        cache = target.new_cache()
        target.forward(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8] * 8]), cache, logits_at=1)
        token = torch.tensor([[9]])
        for i in range(repeats + 3):
            if i == 3:
                start = time.perf_counter()
            target.forward(token, cache).rows(0, 1)
            target.rollback(cache, 64)
        return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    target = load_engine("smollm2-135m", "none", "cpu").target
    for where in ("main thread", "later thread", "main thread"):
        if where == "main thread":
            ms = forward_ms(target)
        else:
            box = []
            worker = threading.Thread(target=lambda: box.append(forward_ms(target)))
            worker.start()
            worker.join()
            ms = box[0]
        print(f"{where:>12}: {ms:.1f} ms per one-token forward", flush=True)


if __name__ == "__main__":
    main()
