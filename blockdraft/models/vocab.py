"""A draft vocabulary subset (FR-Spec, arXiv 2502.14856): the drafter scores only the most
frequent target tokens, so its share of the LM head shrinks from V rows to V_d.

The target's verification is untouched, so greedy output cannot change; a draft token outside
the subset is simply never proposed. At T > 0 the draft distribution q lives on the subset
(zero elsewhere), and rejection sampling against the target's full p stays exact.

Stored in the drafter's directory as `vocab/draft_vocab.safetensors`, in the convention of vLLM's
speculators (`d2t`: per draft id the offset to its target id, target = draft + d2t[draft]; `t2d`:
per target id whether it is in the subset). config.json and model.safetensors are not touched, so
vLLM, SGLang and the reference `DFlashDraftModel` load the drafter exactly as before (they score
the full vocabulary). The subfolder matters: vLLM loads every `*.safetensors` at a checkpoint's top
level and refuses the drafter over a `d2t` its DFlash model has no parameter for (found by the
vLLM check, docs/vllm.md). A file at the top level (`LEGACY_VOCAB_FILE`, as before) is still read,
and moved into the subfolder whenever the drafter is saved or given a subset again. Saved with the
drafter (`save_draft`), the file carries that save's stamp, so that a subset of another save is told
apart (checkpoint.py); one given later (`blockdraft vocab`) carries none and is the user's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import BlockdraftError

VOCAB_FILE = "vocab/draft_vocab.safetensors"
LEGACY_VOCAB_FILE = "draft_vocab.safetensors"


def most_frequent(token_lists, size: int, vocab: int) -> torch.Tensor:
    """The `size` most frequent ids over lists of token ids (ties by lower id), sorted by id."""
    if size < 1:
        raise BlockdraftError(f"the draft vocabulary needs at least one token (got {size})")
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids in token_lists:
        if len(ids):
            counts += torch.bincount(torch.as_tensor(list(ids), dtype=torch.long), minlength=vocab)[:vocab]
    seen = int((counts > 0).sum())
    if seen == 0:
        raise BlockdraftError("no tokens to count for the draft vocabulary")
    order = torch.sort(-counts, stable=True).indices[: min(size, seen)]  # most frequent first, ties by id
    return order.sort().values


def coverage(token_lists, ids: torch.Tensor) -> float:
    """The fraction of the tokens in `token_lists` that the subset `ids` holds."""
    total = sum(len(x) for x in token_lists)
    inside = sum(int(torch.isin(torch.as_tensor(list(x), dtype=torch.long), ids).sum())
                 for x in token_lists if len(x))
    return inside / total if total else 0.0


def save_vocab(directory: str | Path, ids: torch.Tensor, vocab: int, metadata: dict[str, str] | None = None) -> Path:
    """Write `vocab/draft_vocab.safetensors` (d2t, t2d) for the sorted target ids `ids`, whole (a
    temp file, fsynced, renamed); `metadata`: save_draft's stamp (checkpoint.py), none when a
    subset is given to a saved drafter."""
    from .files import fsync_path, save_safetensors

    ids = torch.as_tensor(ids, dtype=torch.long)
    _check(ids, vocab, str(directory))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    path = Path(directory) / VOCAB_FILE
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    save_safetensors({"d2t": ids - torch.arange(len(ids)), "t2d": t2d}, tmp, {"format": "pt", **(metadata or {})})
    tmp.chmod(0o644)  # meant to be shared with the checkpoint
    fsync_path(tmp)
    tmp.replace(path)
    (Path(directory) / LEGACY_VOCAB_FILE).unlink(missing_ok=True)
    return path


def remove_vocab(directory: str | Path) -> None:
    """Drop the subset (both locations): the drafter scores the full vocabulary again."""
    for name in (VOCAB_FILE, LEGACY_VOCAB_FILE):
        (Path(directory) / name).unlink(missing_ok=True)


def vocab_file(directory: str | Path) -> Path | None:
    """The subset file a drafter directory holds (the legacy top-level one if only it), or None."""
    for name in (VOCAB_FILE, LEGACY_VOCAB_FILE):
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


def load_vocab(directory: str | Path, vocab: int) -> torch.Tensor | None:
    """The subset's sorted target ids, or None if the drafter has no subset file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = vocab_file(directory)
    if path is None:
        return None
    try:
        data = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise BlockdraftError(f"{path}: not a readable safetensors file ({err})") from err
    if "d2t" not in data or data["d2t"].dim() != 1:
        raise BlockdraftError(f"{path}: no d2t vector")
    d2t = data["d2t"].long()
    ids = d2t + torch.arange(len(d2t))
    _check(ids, vocab, str(path))
    t2d = data.get("t2d")
    if t2d is not None and (t2d.shape != (vocab,) or not torch.equal(t2d.nonzero()[:, 0], ids)):
        raise BlockdraftError(f"{path}: t2d does not match d2t")
    return ids


def _check(ids: torch.Tensor, vocab: int, where: str) -> None:
    if ids.dim() != 1 or len(ids) == 0:
        raise BlockdraftError(f"{where}: the draft vocabulary is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise BlockdraftError(f"{where}: draft vocabulary ids outside the target's vocabulary of {vocab}")
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise BlockdraftError(f"{where}: draft vocabulary ids must be sorted and unique")


def top_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the `k` best scores of each row [..., k], best first (k = 1: the argmax, the
    first of tied bests)."""
    return scores.argmax(-1, keepdim=True) if k == 1 else scores.topk(k, dim=-1).indices


@dataclass
class Ranked:
    """Each row's `k` best tokens, best first, with their probabilities under the row's softmax:
    a token tree's candidates and the drafter's confidence in each (tree.py)."""

    ids: torch.Tensor  # [..., k]
    probs: torch.Tensor  # [..., k] fp32


def ranked(scores: torch.Tensor, k: int) -> Ranked:
    """`top_ids(scores, k)` (k > 1: the same top-k) and their softmax probabilities."""
    logp = scores.float().log_softmax(-1)
    values, ids = logp.topk(min(k, scores.shape[-1]), dim=-1)
    return Ranked(ids, values.exp())


class SubsetHead(nn.Module):
    """The target's LM head restricted to the subset's rows (all rows: a copy in another dtype). Its logits keep the full vocabulary's
    shape [..., V] (-inf outside the subset), so proposals and q need no index mapping."""

    def __init__(self, head_weight: torch.Tensor, ids: torch.Tensor):
        super().__init__()
        self.vocab = head_weight.shape[0]
        self.register_buffer("ids", ids.to(head_weight.device), persistent=False)
        self.rows = nn.Linear(head_weight.shape[1], len(ids), bias=False, device=head_weight.device,
                              dtype=head_weight.dtype)
        with torch.no_grad():
            self.rows.weight.copy_(head_weight[self.ids])
        self.rows.weight.requires_grad_(False)

    def top(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """The target ids of each row's `k` best tokens [..., k], best first: `top_ids(forward(hidden), k)`
        without the full vocabulary's logits (at most the subset's size; the ids are sorted, so the
        first best of the subset is the first best of the full row, ties included)."""
        return self.ids[top_ids(self.rows(hidden), min(k, len(self.ids)))]

    def ranked(self, hidden: torch.Tensor, k: int) -> Ranked:
        """`ranked(forward(hidden), k)` on the subset's rows (the softmax over the subset: the
        full row's, since every other token scores -inf)."""
        best = ranked(self.rows(hidden), min(k, len(self.ids)))
        return Ranked(self.ids[best.ids], best.probs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = self.rows(hidden)  # [..., V_d]
        if sub.shape[-1] == self.vocab:  # every row (a copy of the head in another dtype)
            return sub
        out = sub.new_full((*sub.shape[:-1], self.vocab), float("-inf"))
        return out.index_copy_(-1, self.ids, sub)  # [..., V]
