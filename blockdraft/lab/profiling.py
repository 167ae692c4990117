"""The cost of each part of a speculative step, by number of tokens: what every speed change is
judged by. `blockdraft bench` reports it beside the per-method phase times of the loop itself
(`StepSeconds`), measured in the same run.

Parts: the target forward's body (decoder layers, taps) over b new tokens after a context, its LM
head over r rows, the cache rollback after a verify that kept only its anchor (for a hybrid
target: the recurrent state restored; the anchor then runs with the next forward); the draft's
context projection of n new positions, its layers over a block of b, and its head over b-1 rows.
Medians of `repeats`.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

BLOCKS = (1, 2, 4, 8, 16)


def timed(fn: Callable[[], object], device: torch.device, repeats: int,
          before: Callable[[], object] | None = None) -> float:
    """Median seconds of `fn` over `repeats` calls (synchronised on CUDA); `before` runs untimed
    ahead of each call (e.g. `evict_caches`)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


EVICT_BYTES = 256 << 20  # more than any CPU cache here, less than a target's weights stream (SmolLM2's: 540 MB)
_EVICT: list = []


def evict_caches() -> None:
    """Write a buffer larger than the CPU's caches: the next call reads its weights from memory, as
    a drafter does in a decode step, right after the target's forward and LM head streamed theirs."""
    if not _EVICT:
        _EVICT.append(torch.zeros(EVICT_BYTES // 4))
    _EVICT[0].add_(1.0)


@torch.inference_mode()
def profile_step(target, draft, context_ids: list[int], blocks=BLOCKS, repeats: int = 7) -> dict:
    """Milliseconds of each part of a step at the context `context_ids` (see the module doc)."""
    from ..models.draft import DraftCache

    dev = target.device
    blocks = sorted({b for b in blocks if b >= 1})
    taps = draft.cfg.target_layer_ids if draft is not None else None
    cache = target.new_cache()
    out = target.forward(torch.tensor([context_ids], device=dev), cache, taps, logits_at=1)
    n = len(context_ids)
    ms = lambda fn: round(1e3 * timed(fn, dev, repeats), 3)  # noqa: E731
    report: dict = {"context_tokens": n, "repeats": repeats, "target_body": {}, "target_head": {}}
    hidden = torch.zeros(max(blocks), target.hidden_size, device=dev, dtype=target.dtype)  # [rows, H]

    def verify(b):
        target.forward(torch.zeros(1, b, dtype=torch.long, device=dev), cache, taps)
        target.rollback(cache, n)

    for b in blocks:
        report["target_body"][b] = ms(lambda b=b: verify(b))
        report["target_head"][b] = ms(lambda b=b: target.lm_head(hidden[:b]))
    big = max(blocks)
    ids = torch.zeros(1, big, dtype=torch.long, device=dev)

    def rollback_only():
        # the commonest step: the anchor kept, every draft rejected (attention K/V are cut; a
        # recurrent state is restored, and the anchor waits for the next forward)
        target.forward(ids, cache, taps)
        t0 = time.perf_counter()
        target.rollback(cache, n + 1)
        seconds = time.perf_counter() - t0
        target.rollback(cache, n)
        return seconds

    report["cache_rollback"] = round(1e3 * sorted(rollback_only() for _ in range(repeats))[repeats // 2], 3)
    if draft is None:
        return report
    report.update(draft_fuse={}, draft_layers={}, draft_head={})
    dcache = DraftCache(len(draft.layers))
    embed, head = target.embed_tokens, draft.head_for(target.lm_head)  # the draft's head: a subset, maybe
    draft.block_hidden(embed, dcache, out.taps, 0, n, big)  # the context's K/V (block_hidden casts the taps)
    empty = out.taps[:, :0]
    taps_b = out.taps[:, -1:].expand(1, big, -1).to(draft.dtype)  # fuse takes them in the draft's dtype
    draft_hidden = hidden.to(draft.dtype)  # so does its head (a bf16 copy where the drafter runs in bf16)
    for b in blocks:
        report["draft_fuse"][b] = ms(lambda b=b: draft.fuse(taps_b[:, :b]))
        if b >= 2:
            report["draft_layers"][b] = ms(lambda b=b: draft.block_hidden(embed, dcache, empty, 0, n, b))
            report["draft_head"][b] = ms(lambda b=b: head(draft_hidden[: b - 1]))
    return report


def format_profile(report: dict) -> str:
    """The profile as a small table: one row per part, one column per number of tokens."""
    parts = [k for k in ("target_body", "target_head", "draft_fuse", "draft_layers", "draft_head") if k in report]
    cols = sorted({b for k in parts for b in report[k]})
    lines = [f"step profile, ms at context {report['context_tokens']} (median of {report['repeats']}); "
             "columns: tokens (head: rows; draft layers/head: block)",
             f"{'part':<14}" + "".join(f"{b:>9}" for b in cols)]
    for k in parts:
        lines.append(f"{k:<14}" + "".join(f"{report[k].get(b, '-'):>9}" for b in cols))
    lines.append(f"{'cache_rollback':<14}{report['cache_rollback']:>9}")
    return "\n".join(lines)
