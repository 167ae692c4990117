"""The drafter's cache at inference: per layer, the K/V of the committed context positions."""

from __future__ import annotations

import torch


class DraftCache:
    """Per-layer K/V of committed context positions only, in buffers that grow by doubling."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V [B, Hkv, n, D] after the committed ones; return the view of all of them. Only
        rows the caller then counts in `length` stay: a decode step's block rows are scratch
        (`DraftAttention.decode`), written over by the next step's context."""
        start, n = self.length, k.shape[2]
        buf = self.k[layer]
        if buf is None or buf.shape[2] < start + n:
            cap = max(64, 2 * (start + n))
            new_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            new_v = v.new_empty(new_k.shape)
            if buf is not None:
                new_k[:, :, :start] = buf[:, :, :start]
                new_v[:, :, :start] = self.v[layer][:, :, :start]
            self.k[layer], self.v[layer] = new_k, new_v
        self.k[layer][:, :, start : start + n] = k
        self.v[layer][:, :, start : start + n] = v
        return self.k[layer][:, :, : start + n], self.v[layer][:, :, : start + n]
