"""The target's cache, and rolling it back exactly after a rejected draft.

A verify forward appends the whole block to the target's cache; after the verdict, everything past
the accepted prefix must go. How depends on what each layer caches (transformers' cache layer
classes, read from the model's own `DynamicCache`, never from a list of model names):

- attention K/V (full, sliding-window, sparse-indexed): cut at the accepted length. Sliding layers
  record their whole past during a forward (`activate_past_recording`) and are cut back to the
  window after it, so a window that slides inside a block is still exact.
- linear-attention state (Gated DeltaNet, Mamba, short convolutions: Qwen3.5, Qwen3-Next, LFM2,
  ...): a recurrent state holds no positions to cut. Before every forward the state is kept
  (`snapshot`); after a partial acceptance it is put back and the accepted tokens wait in the
  `TargetCache` to run in front of the next forward's own, which leaves the state exactly where
  plain decoding would have it, without a replay forward of their own.

Any other layer class (or a model that takes no `past_key_values`) is refused when the target is
wrapped (`check_rollback`), and a model whose block forward or rollback strays from plain decoding
by a probe when an engine is built (`probe_rollback`), naming the family and the cause: never run,
never silently wrong. A verified token tree keeps only its accepted path (`keep_positions`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicLayer

from ..errors import BlockdraftError


def _layer_kinds() -> dict[type, str]:
    from transformers import cache_utils as cu

    return {cu.DynamicLayer: "attention", SlotLayer: "attention", cu.DynamicIndexedLayer: "attention",
            cu.DynamicSlidingWindowLayer: "sliding", cu.LinearAttentionLayer: "state",
            cu.LinearAttentionAndFullAttentionLayer: "state+attention",
            cu.LinearAttentionAndSlidingWindowAttentionLayer: "state+sliding"}


def layer_kinds(cache) -> list[str]:
    """What each layer of a fresh cache holds: "attention", "sliding", "state", "state+attention",
    "state+sliding", or the class name of a layer this module cannot roll back."""
    known = _layer_kinds()
    return [known.get(type(layer), type(layer).__name__) for layer in cache.layers]


def check_rollback(model, cache) -> list[str]:
    """Refuse (BlockdraftError) a target whose cache cannot be rolled back exactly; else return
    its layer kinds."""
    family = getattr(model.config, "model_type", type(model).__name__)
    base = getattr(model, "base_model", model)
    if "past_key_values" not in inspect.signature(base.forward).parameters:
        raise BlockdraftError(
            f"target family {family!r} ({type(model).__name__}) is not supported: it takes no "
            "`past_key_values` cache, so a rejected draft could not be rolled back exactly"
        )
    from transformers import cache_utils as cu

    if not cache.layers and getattr(cache, "layer_class_to_replicate", None) is not cu.DynamicLayer:
        raise BlockdraftError(f"target family {family!r}: its cache has no layers this engine can inspect")
    kinds = layer_kinds(cache)
    known = set(_layer_kinds().values())
    bad = sorted({k for k in kinds if k not in known})
    if bad:
        raise BlockdraftError(
            f"target family {family!r} ({type(model).__name__}) is not supported: its cache layers "
            f"{bad} hold state that this engine cannot roll back exactly after a rejected draft "
            "(supported: attention K/V, sliding-window K/V, linear-attention/convolution states)"
        )
    if not any(k in ("attention", "sliding") or k.endswith(("+attention", "+sliding")) for k in kinds):
        raise BlockdraftError(
            f"target family {family!r} ({type(model).__name__}) is not supported: its cache has no "
            "attention layer, only recurrent states (all-recurrent models such as Mamba are not supported yet)"
        )
    return kinds


def _is_state(layer) -> bool:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin)


@dataclass
class StateSnapshot:
    """The linear-attention states of a cache at `length` tokens, before a forward."""

    length: int
    conv: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (layer, state, tensor)
    recurrent: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class TargetCache:
    """The target's cache as the engine holds it: transformers' own cache (`kv`) and, for a hybrid
    target after a partial acceptance, the accepted tokens that its recurrent state has not taken
    in yet (`pending` [1, P]). The next forward runs them first, in front of its own tokens, so the
    replay costs no forward of its own (`Target.forward` / `Target.rollback`)."""

    kv: object  # transformers' DynamicCache
    pending: torch.Tensor | None = None  # [1, P] token ids, committed, not yet in `kv`
    ran: torch.Tensor | None = None  # [1, T] every token the last forward ran (pending ones first)
    snap: StateSnapshot | None = None  # the recurrent states before the last forward

    @property
    def num_pending(self) -> int:
        return 0 if self.pending is None else self.pending.shape[1]

    def get_seq_length(self) -> int:
        """Tokens committed to the cache, pending ones included."""
        return self.kv.get_seq_length() + self.num_pending


def snapshot(cache) -> StateSnapshot | None:
    """Keep the recurrent and convolution states (None when the cache has none: attention only).
    Recurrent states are updated in place, so they are copied; convolution states are replaced by a
    new tensor on every forward (past recording), so a reference is enough."""
    snap = None
    for i, layer in enumerate(cache.layers):
        if not _is_state(layer):
            continue
        snap = snap or StateSnapshot(cache.get_seq_length())
        for s in range(layer.number_of_states):
            if layer.conv_states[s] is not None:
                snap.conv.append((i, s, layer.conv_states[s]))
            if layer.recurrent_states[s] is not None:
                snap.recurrent.append((i, s, layer.recurrent_states[s].clone()))
    return snap


def restore(cache, snap: StateSnapshot) -> None:
    """Put a snapshot's states back (after `crop` to `snap.length`)."""
    for i, s, t in snap.conv:
        cache.layers[i].conv_states[s] = t
    for i, s, t in snap.recurrent:
        cache.layers[i].recurrent_states[s].copy_(t)  # in place: the cache may hold a static address


def _crop_states(layer, remove: int) -> None:
    # keep the convolution window as of `remove` tokens ago (past recording kept them all)
    for s in range(layer.number_of_states):
        conv, width = layer.conv_states[s], layer.conv_kernel_size[s]
        if conv is not None and width is not None:
            end = conv.shape[-1] - remove
            layer.conv_states[s] = conv[..., max(0, end - width): end]


def crop(cache, length: int) -> None:
    """Cut every layer's K/V to the first `length` tokens and trim recorded past back to what the
    next forward needs. Recurrent states are not touched: `restore` a snapshot for those."""
    remove = cache.get_seq_length() - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}")
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    for layer in cache.layers:
        if _is_state(layer):
            _crop_states(layer, remove)
            # a hybrid layer also holds attention K/V: the attention base class crops those
            attention = super(LinearAttentionCacheLayerMixin, layer)
            if hasattr(attention, "crop"):
                attention.crop(-remove)
        else:
            layer.crop(-remove)  # negative: remove that many (0 trims a sliding layer to its window)


SPARE_SLOTS = 64  # room a K/V buffer keeps beyond its entries when it grows (at least; or half again)


def kv_room(layer, batch: int, heads: int, t: int, dk: int, dv: int,
            like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A plain attention layer's K/V buffers [B, H, capacity, Dk / Dv] (of `like`'s dtype and
    device) with room for t entries after its n entries, and n. transformers' layer concatenates on every update,
    copying the whole cache of every layer at every step; a buffer is written in place, the
    layer's keys/values being views of its first slots. Whatever replaced keys/values since (a
    join or leave of the slot cache, a batch reorder) is copied into a new buffer once; cutting
    entries off the end (views again) and compacting in place keep the buffer."""
    if not layer.is_initialized:
        layer.lazy_initialization(like, like)
    old_k, old_v = layer.keys, layer.values
    n = old_k.shape[2] if old_k.dim() == 4 else 0
    buf = layer.__dict__.get("buffer")
    fits = buf is not None and n > 0 and old_k.data_ptr() == buf[0].data_ptr() \
        and old_v.data_ptr() == buf[1].data_ptr() and old_k.stride() == buf[0].stride() \
        and old_v.stride() == buf[1].stride() and tuple(buf[0].shape[:2]) == (batch, heads) \
        and n + t <= buf[0].shape[2]
    if not fits:
        room = n + t + max(SPARE_SLOTS, (n + t) // 2)
        buf = (like.new_empty(batch, heads, room, dk), like.new_empty(batch, heads, room, dv))  # [B, H, capacity, D]
        if n:
            buf[0][:, :, :n], buf[1][:, :, :n] = old_k, old_v
        layer.buffer = buf
    return buf[0], buf[1], n


class SlotLayer(DynamicLayer):
    """A plain attention cache layer whose `update` writes the new K/V [B, H, T, D] into the room
    after its slots in a buffer (`kv_room`) instead of concatenating (transformers' `DynamicLayer`
    copies the whole cache of every layer at every step: a quarter of a 16-sequence step's time on
    SmolLM2, `python scripts/batch_forward.py`); its keys/values are the buffer's first slots. The
    slot cache's layers (decoding/slots.py), swapped in for the prefill's `DynamicLayer`s."""

    @classmethod
    def of(cls, layer: DynamicLayer) -> "SlotLayer":
        """The same entries (keys, values and their buffer, shared) in a layer of this class."""
        new = cls()
        new.__dict__.update(layer.__dict__)
        return new

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        b, h, t, dk = keys.shape
        kbuf, vbuf, n = kv_room(self, b, h, t, dk, values.shape[3], keys)
        kbuf[:, :, n:n + t], vbuf[:, :, n:n + t] = keys, values
        self.keys, self.values = kbuf[:, :, :n + t], vbuf[:, :, :n + t]
        return self.keys, self.values


def plain_attention(layer) -> bool:
    """Whether a cache layer is plain attention K/V: transformers' DynamicLayer or our SlotLayer
    (not a sliding window, a recurrent state or any other subclass)."""
    return type(layer) is DynamicLayer or type(layer) is SlotLayer


def tree_capable(kv) -> bool:
    """Whether every layer is plain attention K/V (what `keep_positions` can compact)."""
    layers = kv.layers or [DynamicLayer()]
    return all(plain_attention(layer) for layer in layers)


def keep_positions(kv, start: int, keep: list[int]) -> None:
    """Keep the first `start` tokens of every layer's K/V and, after them, the entries `keep`
    (indices past `start`, in order): a verified tree's accepted path. Plain attention layers only
    (`tree_capable`; a tree is refused for other caches)."""
    m = len(keep)
    moved = keep != list(range(m))  # a path of the first nodes (the likeliest) only needs a crop
    idx = torch.tensor(keep, dtype=torch.long)
    for layer in kv.layers:
        k, v = layer.keys, layer.values  # [B, H, T, D]
        if moved:  # the path's entries to the front, in place (index_select copies them first)
            i = (start + idx).to(k.device)
            k[:, :, start:start + m] = k.index_select(2, i)
            v[:, :, start:start + m] = v.index_select(2, i)
        layer.keys, layer.values = k[:, :, :start + m], v[:, :, :start + m]


@torch.inference_mode()
def probe_rollback(target) -> float:
    """How far a speculative step's logits stray from plain decoding's, on a few fixed tokens:
    a block continuing a cached prefix, two of its tokens kept, the rest rolled back, then the
    next two; against one token at a time. The relative error of the logits (rounding only,
    for a cache that rolls back exactly; a model whose multi-token forward ignores its cached
    state, or whose state leaks a rejected token, is far off)."""
    v = target.vocab_size
    ids = [(7 * i + 3) % v for i in range(10)]
    prefix, kept, junk = ids[:4], ids[4:8], ids[8:10]

    def start():
        cache = target.new_cache()
        target.forward(torch.tensor([prefix], device=target.device), cache, logits_at=1)
        target.rollback(cache, len(prefix))
        return cache

    cache, plain = start(), []
    for t in kept:  # plain decoding: one token per forward
        plain.append(target.forward(torch.tensor([[t]], device=target.device), cache).logits[0, -1])
        target.rollback(cache, cache.get_seq_length())
    cache = start()
    block = torch.tensor([kept[:2] + junk], device=target.device)  # [1, 4]: two kept, two rejected
    first = target.forward(block, cache).logits[0, :2]
    target.rollback(cache, len(prefix) + 2)
    second = target.forward(torch.tensor([kept[2:]], device=target.device), cache).logits[0]
    want, got = torch.stack(plain).float(), torch.cat([first, second]).float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
