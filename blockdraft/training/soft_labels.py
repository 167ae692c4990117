"""Soft labels: the target's top-k next-token distribution at every position of the training
data, for a loss against the target's distribution rather than its argmax (the cross entropy to
its softmax, KL up to a constant, as vLLM's speculators trains against the verifier's logits).

Cached once per data directory and k beside the features (`soft-train-topK/`, resumable), as
fp32 rows [k token ids | k logits]: ids are exact in fp32 below 2^24. The distribution is the
softmax of the k logits, renormalised over them (the rest of the vocabulary carries little mass
where a drafter can match the target at all).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .features import CachedFeatures, build_cache


def soft_dir(data_dir: str | os.PathLike, split: str, k: int) -> Path:
    return Path(data_dir) / f"soft-{split}-top{k}"


@torch.inference_mode()
def topk_rows(target, seqs: list[list[int]], k: int, pad_id: int = 0) -> list[np.ndarray]:
    """[S, 2k] fp32 per sequence: the target's k likeliest next tokens at each position, then their
    logits. One right-padded forward over the group (causal: the pads change no real row)."""
    ids = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    logits = target.forward(ids.to(target.device), target.new_cache()).logits.float()  # [n, S, V]
    values, index = logits.topk(k, dim=-1)  # [n, S, k] each
    rows = torch.cat([index.float(), values], dim=-1).cpu().numpy()
    return [rows[r, : len(s)] for r, s in enumerate(seqs)]


def build_soft_labels(data_dir, split: str, samples: list[dict], target, k: int,
                      progress: bool = True) -> CachedFeatures:
    return build_cache(soft_dir(data_dir, split, k), samples, 2 * k, lambda seqs: topk_rows(target, seqs, k),
                       f"soft labels top-{k} ({split})", progress, chunk=4, dtype=np.float32, filename="topk.f32")


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2k] cached rows -> (token ids [..., k] long, probabilities [..., k] summing to 1)."""
    k = rows.shape[-1] // 2
    return rows[..., :k].long(), torch.softmax(rows[..., k:].float(), dim=-1)
