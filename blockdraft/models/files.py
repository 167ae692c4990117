"""Writing files whole and durably: a checkpoint's or a vocabulary's safetensors, and the fsync
that makes a save survive losing the machine (checkpoint.py, vocab.py, training/state.py)."""

from __future__ import annotations

import json
import os

import torch


def save_safetensors(tensors: dict[str, torch.Tensor], path, metadata: dict[str, str]) -> None:
    """safetensors' `save_file`, with the metadata in sorted order: safetensors writes it in hash
    order, which differs from one process to the next, and a drafter saved twice (a committed one
    saved again) should be the same bytes. Reordering keys keeps the header's length, so the
    tensors' offsets stay as they are."""
    import struct

    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        raw = f.read(size)
        header = json.loads(raw)
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        again = json.dumps(header, separators=(",", ":")).encode()
        if len(again) == len(raw.rstrip(b" ")):  # as serde wrote it, but for the order: rewrite in place
            f.seek(8)
            f.write(again)


def fsync_path(path) -> None:
    """Flush a file's data (or a directory's entries: a rename in it) to the disk, so that a save
    survives losing the machine too, not only a killed process. A directory cannot be opened for
    this on some systems (Windows): there the file system keeps the rename as it may."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
