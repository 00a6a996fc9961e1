"""Chunk checksums: xxh3-64, computed by the worker at store time, checked on every load."""

from __future__ import annotations

import numpy as np
import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"


def digest(data: np.ndarray | bytes | memoryview) -> int:
    """64-bit xxh3 of a buffer's bytes (zero-copy for contiguous numpy arrays)."""
    return xxhash.xxh3_64_intdigest(data)
