"""One packed training batch and its loss (DFLASH.md's recipe): random anchors among response
tokens, all blocks of a step in one forward under a boolean block mask, the position-decayed
cross entropy, over the full vocabulary or a sampled part of it (the LM head dominates the cost).
`cfg` is the run's TrainConfig (train.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.draft import DraftModel


def default_gamma(block_size: int) -> float:
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.3))


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def sample_anchors(loss_mask: list[int], n: int, block_size: int, gen: torch.Generator,
                   mode: str = "random") -> torch.Tensor:
    """Up to n distinct anchors a, uniformly among response positions with a <= S - B, sorted.
    mode "split": only the anchors that cut the response into consecutive blocks from its first
    token (a fixed split, as a chain of steps that each accept the whole block would meet)."""
    seq_len = len(loss_mask)
    valid = [a for a in range(1, seq_len - block_size + 1) if loss_mask[a]]
    if mode == "split" and valid:
        valid = [a for a in valid if (a - valid[0]) % block_size == 0]
    if not valid:
        return torch.empty(0, dtype=torch.long)
    pick = torch.randperm(len(valid), generator=gen)[:n]
    return torch.tensor(valid, dtype=torch.long)[pick].sort().values


def block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[N*B, context_len + N*B] bool: block b's queries see context j < a_b and their own block."""
    n = anchors.shape[0]
    block_of = torch.arange(n * block_size) // block_size  # [N*B]
    ctx = torch.arange(context_len)[None, :] < anchors[block_of][:, None]  # [N*B, S]
    own = block_of[:, None] == block_of[None, :]  # [N*B, N*B]
    return torch.cat([ctx, own], dim=1)


@dataclass
class Batch:
    taps: torch.Tensor  # [Bs, S, K*H]
    block_ids: torch.Tensor  # [Bs, N*B]
    positions: torch.Tensor  # [Bs, N*B]
    labels: torch.Tensor  # [Bs, N, B-1]
    weights: torch.Tensor  # [Bs, N, B-1]: decay weight x label loss mask (0 for padding blocks)
    mask: torch.Tensor  # [Bs, 1, N*B, S + N*B]
    soft_ids: torch.Tensor | None = None  # [Bs, N, B-1, k]: the target's top-k tokens at each label
    soft_p: torch.Tensor | None = None  # [Bs, N, B-1, k]: their probabilities


def make_batch(samples, feats, indices, cfg, mask_id: int, gen_for, soft=None) -> Batch:
    B, N = cfg.block_size, cfg.anchors
    w = loss_weights(B, cfg.gamma or default_gamma(B))
    rows = []
    tap_rows = feats.get_many(indices, cfg.max_seq_len)  # on the target's device when computed online
    for j, i in enumerate(indices):
        ids, lm = samples[i]["input_ids"][: cfg.max_seq_len], samples[i]["loss_mask"][: cfg.max_seq_len]
        # nxt[t]: the label for position t + 1 (the next token, or the target's prediction of it)
        nxt = samples[i]["target_next"][: len(ids)] if cfg.labels == "target" else ids[1:] + [0]
        rows.append((torch.tensor(ids), torch.tensor(lm), tap_rows[j][: len(ids)],
                     sample_anchors(lm, N, B, gen_for(j), cfg.anchor_mode), torch.tensor(nxt)))
    S = max(r[0].shape[0] for r in rows)
    width = rows[0][2].shape[1]
    bs = len(rows)
    taps = torch.zeros(bs, S, width, device=rows[0][2].device)
    block_ids = torch.full((bs, N * B), mask_id, dtype=torch.long)
    positions = torch.zeros(bs, N * B, dtype=torch.long)
    labels = torch.zeros(bs, N, B - 1, dtype=torch.long)
    weights = torch.zeros(bs, N, B - 1)
    mask = torch.zeros(bs, 1, N * B, S + N * B, dtype=torch.bool)
    k = cfg.soft_labels if soft is not None else 0
    soft_rows = torch.zeros(bs, N, B - 1, 2 * k)
    for r, (ids, lm, f, anchors, nxt) in enumerate(rows):
        taps[r, : f.shape[0]] = f
        n = anchors.shape[0]
        # padding blocks (short sequences) sit at anchor 0 with weight 0: they see only themselves
        full = torch.cat([anchors, torch.zeros(N - n, dtype=torch.long)])
        offs = full[:, None] + torch.arange(B)[None, :]  # [N, B]
        block_ids[r, ::B] = ids[full]
        positions[r] = offs.reshape(-1)
        labels[r, :n] = nxt[offs[:n, 1:] - 1]
        if k:  # the distribution at position t predicts token t + 1, as nxt[t] does
            soft_rows[r, :n] = soft.get(indices[r])[offs[:n, 1:] - 1]
        weights[r, :n] = w[None, :] * lm[offs[:n, 1:]].float()
        m = block_mask(full, S, B)
        m[n * B :, :S] = False
        mask[r, 0] = m
    if not k:
        return Batch(taps, block_ids, positions, labels, weights, mask)
    from .soft_labels import split_rows

    return Batch(taps, block_ids, positions, labels, weights, mask, *split_rows(soft_rows))


def frequent_tokens(samples, n: int, vocab: int) -> torch.Tensor:
    """The n most frequent response tokens of the training data, sorted by id."""
    ids = torch.tensor([t for smp in samples for t, m in zip(smp["input_ids"], smp["loss_mask"]) if m])
    counts = torch.bincount(ids, minlength=vocab)
    return counts.topk(min(n, int((counts > 0).sum()))).indices.sort().values


def head_rows(frequent: torch.Tensor | None, vocab: int, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
    """Vocabulary rows for this step's loss: the frequent tokens, this batch's labels (so every
    label is in the softmax) and random negatives. None = the full vocabulary."""
    if frequent is None:
        return None
    others = torch.randint(0, vocab, (frequent.shape[0] // 2,), generator=gen)
    return torch.unique(torch.cat([frequent, labels.flatten().cpu(), others]))


def training_forward(draft: DraftModel, target, batch: Batch, tap_scale: torch.Tensor | None,
                     rows: torch.Tensor | None = None):
    """Weighted CE sum, weight sum and per-position correct counts for one packed batch.
    rows: restrict the softmax to these vocabulary rows (sorted ids containing every label)."""
    dev = target.device
    taps = batch.taps.to(dev)
    if tap_scale is not None:
        taps = taps / tap_scale.to(dev)
    with torch.no_grad():
        embeds = target.embed_tokens(batch.block_ids.to(dev))  # frozen, shared
    S = taps.shape[1]
    hidden = draft(embeds, batch.positions.to(dev), taps, torch.arange(S, device=dev), None, batch.mask.to(dev))
    bs, nb, H = hidden.shape
    B = batch.labels.shape[2] + 1
    hidden = hidden.view(bs, nb // B, B, H)[:, :, 1:]  # [Bs, N, B-1, H]: positions 1..B-1 predict
    weights = batch.weights.to(dev)
    keep = weights > 0
    labels = batch.labels.to(dev)[keep]
    if rows is None:
        logits = target.lm_head(hidden[keep])  # [M, V]
    else:
        rows = rows.to(dev)
        logits = hidden[keep] @ target.lm_head.weight[rows].T  # [M, |rows|]
        labels = torch.searchsorted(rows, labels)  # position of each label among the rows
    if batch.soft_ids is None:
        ce = F.cross_entropy(logits.float(), labels, reduction="none")
    else:  # the cross entropy to the target's top-k distribution
        soft_ids = batch.soft_ids.to(dev)[keep]  # [M, k]
        if rows is not None:
            soft_ids = torch.searchsorted(rows, soft_ids)
        ce = -(batch.soft_p.to(dev)[keep] * F.log_softmax(logits.float(), -1).gather(1, soft_ids)).sum(-1)
    correct = torch.zeros(B - 1, device=dev)
    pos = torch.arange(B - 1, device=dev).expand_as(weights)[keep]
    correct.index_add_(0, pos, (logits.argmax(-1) == labels).float())
    counts = torch.zeros(B - 1, device=dev).index_add_(0, pos, torch.ones_like(pos, dtype=torch.float))
    return (ce * weights[keep]).sum(), weights.sum(), correct, counts
