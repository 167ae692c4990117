"""A drafter's tau by replay: the engine's greedy steps without the target's verify forwards.

At temperature 0 speculative decoding outputs the target's greedy continuation whatever the
drafter proposes; only how many tokens each step commits depends on the drafter. So tau can be
measured by replaying `decode_steps` against that continuation (the reference): one target prefill
over prompt + reference gives the taps of every position (the draft's context), and each step
runs only the draft forward and compares its block with the reference. Same anchors, contexts and
blocks as the engine at a fixed block size, hence the same acceptance lengths (tested; the taps
come from one prefill instead of step-by-step forwards, equal up to float rounding).
References are computed once per target, prompt and length, and cached in a JSON file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.draft import DraftCache, DraftModel
from ..models.target import Target, cache_dir


@dataclass
class ReplayResult:
    acceptance_lengths: list[int]  # tokens committed per decode step, as GenerationStats has them

    @property
    def tau(self) -> float:
        n = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / n if n else 1.0


def default_references_path(target: str) -> Path:
    """Where greedy references are cached for a target (shared by `blockdraft tau` and `bench`)."""
    return cache_dir() / "references" / f"{Path(target).name}.json"


def _key(prompt_ids: list[int], max_new_tokens: int) -> str:
    return f"{max_new_tokens}:" + hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:24]


def _is_greedy(target: Target, prompt_ids: list[int], continuation: list[int]) -> bool:
    """Does one prefill over prompt + continuation predict every continuation token?"""
    ids = torch.tensor([prompt_ids + continuation], device=target.device)
    logits = target.forward(ids, target.new_cache(), logits_at=len(continuation) + 1).logits
    return logits[0, :-1].argmax(-1).tolist() == continuation


@torch.inference_mode()
def reference_continuations(
    target: Target, prompts: list[list[int]], max_new_tokens: int, path: str | os.PathLike | None = None,
    batch_size: int = 8, progress: bool = True,
) -> list[list[int]]:
    """The target's greedy continuation of each prompt (ending at EOS or max_new_tokens).

    Generated in batches (`Target.greedy_batch`) of prompts of similar length for speed (a batch is
    left-padded to its longest prompt, and padding's prefill is wasted), then each one checked by a prefill:
    padding changes the float rounding, which can flip a near-tie; a continuation that fails the
    check is regenerated alone by plain decoding. Cached in `path` (resumable).
    """
    from tqdm import tqdm

    from ..decoding.engine import Engine, GenerationConfig

    cache = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
    todo = [i for i, p in enumerate(prompts) if _key(p, max_new_tokens) not in cache]
    todo.sort(key=lambda i: len(prompts[i]))
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="references", unit="prompt",
               disable=not progress)
    for lo in range(0, len(todo), batch_size):
        group = [prompts[i] for i in todo[lo : lo + batch_size]]
        for p, cont in zip(group, target.greedy_batch(group, max_new_tokens)):
            if not _is_greedy(target, p, cont):
                cont = Engine(target).generate(p, GenerationConfig(max_new_tokens=max_new_tokens)).token_ids
            cache[_key(p, max_new_tokens)] = cont
            bar.update(1)
        if path:
            tmp = Path(str(path) + ".tmp")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(cache))
            tmp.replace(path)
    bar.close()
    return [cache[_key(p, max_new_tokens)] for p in prompts]


@torch.inference_mode()
def replay(target: Target, draft: DraftModel, prompt_ids: list[int], reference: list[int],
           block_size: int, max_new_tokens: int) -> ReplayResult:
    """Acceptance lengths `decode_steps` would give at temperature 0 and a fixed block size."""
    seq = torch.tensor([prompt_ids + reference], device=target.device)
    taps = target.forward(seq, target.new_cache(), draft.cfg.target_layer_ids, logits_at=1).taps  # [1, S, K*H]
    cache = DraftCache(len(draft.layers))
    p = len(prompt_ids)
    budget = min(max_new_tokens, target.max_context - p)
    n, lengths = 1, []  # reference[0] came from the prefill; n tokens are committed
    while n < len(reference):
        position = p + n - 1  # the anchor reference[n-1] sits here
        block = min(block_size, budget - n + 1, target.max_context - position)
        accepted = 0
        if block > 1:
            accepted = draft.matching_prefix(target.embed_tokens, draft.head_for(target.lm_head), cache,
                                             taps[:, cache.length : position],
                                             reference[n - 1], position, block, reference[n : n + block - 1])
        step = min(accepted + 1, len(reference) - n)  # the EOS or the length limit ends the last step
        lengths.append(step)
        n += step
    return ReplayResult(lengths)
