"""One switch for every kernel of this package: `use_packed(False)` (a context manager, per
thread) runs transformers' own layers, norms and attention again, for baselines that must be what
transformers does by itself; the packed layers, fused norms and shared-K/V attention read
`packed_enabled()` at each call."""

from __future__ import annotations

import contextlib
import threading

_STATE = threading.local()


@contextlib.contextmanager
def use_packed(enabled: bool):
    """Within the block, our kernels run (True) or every module runs as transformers runs it (False)."""
    before = packed_enabled()
    _STATE.enabled = enabled
    try:
        yield
    finally:
        _STATE.enabled = before


def packed_enabled() -> bool:
    """False within `use_packed(False)` (in this thread)."""
    return _STATE.__dict__.get("enabled", True)
