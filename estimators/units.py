"""Unit constants. GB is 1e9 bytes, GiB is 2**30 bytes (formulas.md convention)."""

from __future__ import annotations

KIB_BYTES = 1024
MIB_BYTES = 1024**2
GIB_BYTES = 1024**3
GB_BYTES = 10**9
TERA = 1e12


def gib(num_bytes: float) -> float:
    """Bytes -> GiB (2**30 bytes)."""
    return num_bytes / GIB_BYTES
