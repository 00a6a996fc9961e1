"""Chunk checksums: xxh3-64, computed by the worker at store time, checked on every load.

Large buffers are hashed through ctypes, which releases the GIL for the call: the
``xxhash`` binding holds it for the whole hash, which stalls
every other Python thread of the process meanwhile: the model runner beside a commit
thread's hash, for one. The C function is the binding's own ``XXH3_64bits`` (its
extension module exports it), checked at import against the binding on a test buffer;
where it is not there or disagrees, the binding serves every size.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

CHECKSUM_ALGORITHM = "xxh3_64"
# Below this the ctypes call costs more than the hash it lets run beside others.
NATIVE_MIN_BYTES = 64 << 10


def binding_library() -> ctypes.CDLL:
    """The ``xxhash`` binding's extension as a C library: it exports the XXH3 functions
    (one-shot here, streaming in :mod:`tierstore.data.fused_copy`). Raises OSError or
    AttributeError where it cannot be loaded so."""
    return ctypes.CDLL(xxhash._xxhash.__file__)  # type: ignore[attr-defined]


def _load_native() -> Callable[[int, int], int] | None:
    """The extension's ``XXH3_64bits(ptr, len)``, if it is there and agrees."""
    try:
        lib = binding_library()
        native = getattr(lib, "XXH3_64bits_dispatch", None) or lib.XXH3_64bits
    except (OSError, AttributeError):
        logger.info("xxh3 through the binding only (its C function is not exported)")
        return None
    native.restype = ctypes.c_uint64
    native.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    probe = np.random.default_rng(0).integers(0, 255, NATIVE_MIN_BYTES + 13, dtype=np.uint8)
    if native(probe.ctypes.data, probe.nbytes) != xxhash.xxh3_64_intdigest(probe):
        logger.warning("the exported XXH3_64bits disagrees with xxhash; not used")
        return None
    return native


_native = _load_native()


def digest(data: np.ndarray | bytes | memoryview) -> int:
    """64-bit xxh3 of a buffer's bytes (zero-copy for contiguous numpy arrays; without
    the GIL for large ones)."""
    if (
        _native is not None
        and isinstance(data, np.ndarray)
        and data.nbytes >= NATIVE_MIN_BYTES
        and data.flags.c_contiguous
    ):
        return _native(data.__array_interface__["data"][0], data.nbytes)
    return xxhash.xxh3_64_intdigest(data)
