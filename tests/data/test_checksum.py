"""The chunk digest is xxh3-64 whatever path computes it (the GIL-free C call for large
buffers, the binding for the rest): a digest stored by one worker verifies on another."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from tierstore.data import checksum

_SIZES = [0, 1, 4095, checksum.NATIVE_MIN_BYTES - 1, checksum.NATIVE_MIN_BYTES, 3 << 20]


def test_the_gil_free_call_is_in_use_here() -> None:
    """On this build the extension exports XXH3_64bits: large digests release the GIL."""
    assert checksum._native is not None


@pytest.mark.parametrize("nbytes", _SIZES)
@pytest.mark.parametrize("start", [0, 1, 7])
def test_digest_equals_xxh3_64_of_the_bytes(nbytes: int, start: int) -> None:
    buffer = np.random.default_rng(nbytes + start).integers(0, 255, nbytes + 8, dtype=np.uint8)
    data = buffer[start : start + nbytes]  # unaligned views too
    want = xxhash.xxh3_64_intdigest(data.tobytes())
    assert checksum.digest(data) == want
    assert checksum.digest(data.tobytes()) == want
    assert checksum.digest(memoryview(data)) == want


def test_a_strided_array_is_hashed_as_its_bytes_in_order() -> None:
    """Not C-contiguous: the binding (which copies or refuses), never a wrong pointer."""
    data = np.arange(2 * checksum.NATIVE_MIN_BYTES, dtype=np.uint8)[::2]
    try:
        got = checksum.digest(data)
    except (ValueError, BufferError):
        return  # refused: a caller can never get a digest of other bytes
    assert got == xxhash.xxh3_64_intdigest(data.tobytes())
