"""What this CPU's instructions are, for the kernels that depend on them."""

from __future__ import annotations


def cpu_flags() -> set[str] | None:
    """The instruction-set flags of this CPU (Linux: read from /proc/cpuinfo); None where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return None
