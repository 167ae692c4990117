"""Several sequences in one target cache: the batch's K/V as rows of one transformers cache.

Row r of every layer's K/V [B, H, S, D] holds sequence r's entries in the slots where
`valid[r]` is True, in order. A forward appends T slots to every row (each row's block, padded to
the longest); the verdict then keeps a row's accepted slots and leaves the rest as holes. Attention
is order-free over keys (positions are in their RoPE), so a row that sees its valid slots through a
mask computes what a cache of its own would, up to the rounding of the sums. Holes cost attention
work, so slots no row holds are cut off the end at once (with one sequence that is every rejected
draft: the same crop as a cache of its own), and the rows are compacted in place once that would cut a
quarter of the slots (and always with one sequence, which keeps it the single-sequence cache).

With every row full and in step (no holes, equal lengths, chains) the forward passes no mask: the
model's own causal mask is the same. Plain attention layers only: a sliding window or a recurrent
state is not a set of slots (`Target.supports_trees`); such targets decode one sequence at a time.
A sequence joins with the cache of its own prefill (`join`) and leaves with its row (`leave`).

A forward appends to every layer in place, into spare room after the slots: the cache's layers
are `SlotLayer`s (cache.py), swapped in for the prefill's at the first join, where transformers'
layer concatenates, copying the whole cache of every layer at every step (a quarter of a
16-sequence step's time on SmolLM2, `python scripts/batch_forward.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.cache import SlotLayer

COMPACT_AT = 0.25  # compact the rows once that would cut this fraction of the slots


@dataclass
class RowBlock:
    """What one row runs in a batch forward: its tokens, and the tree they are (None: a chain)."""

    ids: list[int]  # anchor first
    tree: object = None  # a tree.Tree over these tokens: node depths and ancestor mask


class OwnCache:
    """One sequence in a cache of its own (target.TargetCache), for any target the engine runs:
    a hybrid target's deferred tokens and sliding windows included. The same interface as
    SlotCache, for a batch of at most one."""

    def __init__(self, target):
        self.target, self.cache, self.start = target, None, 0  # start: cache length before the forward

    def join(self, cache) -> None:
        if self.cache is not None:
            raise ValueError(f"target {self.target.name!r} decodes one sequence at a time (its cache "
                             f"holds {sorted(set(self.target.cache_kinds))}, not slots of plain attention)")
        self.cache = cache

    def leave(self, row: int) -> None:
        self.cache = None

    def forward(self, target, blocks: list[RowBlock], taps):
        b = blocks[0]
        self.start = self.cache.get_seq_length()
        ids = torch.tensor([b.ids], dtype=torch.long, device=target.device)
        return target.forward(ids, self.cache, taps, tree=b.tree)

    def keep(self, rows: list[list[int]]) -> None:
        kept = rows[0]
        if kept == list(range(len(kept))):
            self.target.rollback(self.cache, self.start + len(kept))
        else:
            self.target.keep_path(self.cache, self.start, kept)


@dataclass
class SlotCache:
    """Every sequence of a batch in one cache, a row each (see the module's docstring)."""

    kv: object = None  # transformers' DynamicCache of batch B (None while empty)
    valid: torch.Tensor | None = None  # [B, S] bool
    lengths: list[int] = field(default_factory=list)  # valid slots per row
    pending = None  # the TargetCache interface Target.forward reads: never pending tokens here
    num_pending = 0

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def holes(self) -> bool:
        """Some slot of some row is not valid (a hole, or a row shorter than the slots)."""
        return self.valid is not None and not bool(self.valid.all())

    @property
    def slots(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    appended: int = 0  # slots the last forward appended to every row

    def join(self, cache) -> None:
        """Add a sequence whose prompt was prefilled into a cache of its own (a TargetCache of
        batch 1), as the last row."""
        kv = cache.kv
        n = kv.get_seq_length()
        if self.kv is None:
            self.kv, self.valid, self.lengths = kv, torch.ones(1, n, dtype=torch.bool), [n]
            kv.layers[:] = [SlotLayer.of(layer) for layer in kv.layers]  # appending in place (cache.py)
            return
        s = max(self.slots, n)
        for mine, theirs in zip(self.kv.layers, kv.layers):
            mine.keys = torch.cat([_pad(mine.keys, s), _pad(theirs.keys, s)])  # [B + 1, H, S, D]
            mine.values = torch.cat([_pad(mine.values, s), _pad(theirs.values, s)])
        row = torch.zeros(1, s, dtype=torch.bool)
        row[0, :n] = True
        self.valid = torch.cat([_pad_mask(self.valid, s), row])
        self.lengths.append(n)

    def leave(self, row: int) -> None:
        """Drop a row (the sequence finished or was cancelled); later rows move up by one."""
        if self.batch == 1:
            self.kv, self.valid, self.lengths = None, None, []
            return
        keep = torch.tensor([r for r in range(self.batch) if r != row])
        for layer in self.kv.layers:
            layer.keys, layer.values = layer.keys.index_select(0, keep.to(layer.keys.device)), \
                layer.values.index_select(0, keep.to(layer.values.device))
        self.valid = self.valid[keep]
        del self.lengths[row]
        self.trim()

    def inputs(self, blocks: list[RowBlock], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The forward's input ids [B, T], positions [B, T] and attention mask [B, 1, T, S + T]
        (None where the model's causal mask is the same), for one block per row."""
        t = max(len(b.ids) for b in blocks)
        ids = torch.zeros(self.batch, t, dtype=torch.long)
        positions = torch.empty(self.batch, t, dtype=torch.long)
        trees = any(b.tree is not None for b in blocks)
        ragged = any(len(b.ids) != t for b in blocks)
        for r, b in enumerate(blocks):
            n = len(b.ids)
            ids[r, :n] = torch.tensor(b.ids)
            ids[r, n:] = b.ids[-1]  # padding: never seen by the row's tokens, dropped after
            depths = torch.tensor(b.tree.depths) if b.tree is not None else torch.arange(n)
            positions[r, :n] = self.lengths[r] + depths
            positions[r, n:] = self.lengths[r] + torch.arange(n, t)
        mask = None
        if self.holes or trees or ragged:
            new = torch.ones(t, t, dtype=torch.bool).tril().repeat(self.batch, 1, 1)  # [B, T, T]
            for r, b in enumerate(blocks):
                if b.tree is not None:
                    n = len(b.ids)
                    new[r, :n, :n] = b.tree.attention_mask()
            seen = self.valid[:, None, :].expand(-1, t, -1)  # [B, T, S]
            mask = torch.cat([seen, new], dim=2)[:, None].to(device)  # [B, 1, T, S + T]
        return ids.to(device), positions.to(device), mask

    def forward(self, target, blocks: list[RowBlock], taps):
        """One target forward over every row's block (a TargetOutput of batch B)."""
        ids, positions, mask = self.inputs(blocks, target.device)
        self.appended = ids.shape[1]
        return target.forward(ids, self, taps, slot_positions=positions, slot_mask=mask)

    def keep(self, rows: list[list[int]]) -> None:
        """After a forward: row r keeps the new slots `rows[r]` (indices into its block: the anchor
        and accepted drafts, or a tree's path); the others become holes."""
        new = torch.zeros(self.batch, self.appended, dtype=torch.bool)
        for r, kept in enumerate(rows):
            new[r, kept] = True
            self.lengths[r] += len(kept)
        self.valid = torch.cat([self.valid, new], dim=1)
        self.trim()

    def trim(self) -> None:
        """Cut the slots no row holds off the end; compact once holes are COMPACT_AT of the slots."""
        if self.kv is None:
            return
        held = self.valid.any(0).nonzero()
        end = int(held[-1]) + 1 if len(held) else 0
        if end < self.slots:
            for layer in self.kv.layers:
                layer.keys, layer.values = layer.keys[:, :, :end], layer.values[:, :, :end]
            self.valid = self.valid[:, :end]
        # Compacting shortens the rows to the longest one: worth it once that saves COMPACT_AT of
        # the slots (rows shorter than the longest keep their padding whatever is done).
        spare = self.slots - max(self.lengths)
        if spare and (self.batch == 1 or spare >= COMPACT_AT * self.slots):
            self.compact()

    @torch.inference_mode()
    def compact(self) -> None:
        """Move every row's valid slots to its front, in order; rows shorter than the longest end
        in holes. Slots before the first hole of any row stay where they are."""
        s = max(self.lengths)
        full = self.valid.all(0)
        first = self.slots if bool(full.all()) else int((~full).nonzero()[0])
        if first < s:
            tail = (~self.valid[:, first:]).to(torch.int8)
            order = first + torch.sort(tail, dim=1, stable=True).indices[:, : s - first]  # [B, s - first]: valid first
            for layer in self.kv.layers:
                k, v = layer.keys, layer.values  # [B, H, S, Dk], [B, H, S, Dv]: MLA's Dv differs from its Dk
                moved_k, moved_v = _gather_slots(k, order), _gather_slots(v, order)  # copies: safe to write back
                k[:, :, first:s], v[:, :, first:s] = moved_k, moved_v
        for layer in self.kv.layers:
            layer.keys, layer.values = layer.keys[:, :, :s], layer.values[:, :, :s]
        self.valid = torch.arange(s)[None] < torch.tensor(self.lengths)[:, None]


def _gather_slots(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The slots `order` [B, S'] of each row of K or V [B, H, S, D], as a new tensor [B, H, S', D]."""
    idx = order.to(t.device)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])  # [B, H, S', D]
    return t.gather(2, idx)


def _pad(t: torch.Tensor, s: int) -> torch.Tensor:
    """K/V [B, H, S0, D] with zero slots appended up to S (a masked zero never yields a NaN)."""
    return t if t.shape[2] == s else torch.cat([t, t.new_zeros(*t.shape[:2], s - t.shape[2], t.shape[3])], dim=2)


def _pad_mask(valid: torch.Tensor, s: int) -> torch.Tensor:
    return valid if valid.shape[1] == s else torch.cat([valid, valid.new_zeros(valid.shape[0], s - valid.shape[1])], 1)
