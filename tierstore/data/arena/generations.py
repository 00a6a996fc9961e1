"""How often each extent of a node's arena was freed, kept in the arena's last bytes: lets
a same-node load read a shard's extent without pinning it (a seqlock).

The NodeStore bumps an extent's slot every time it frees that extent, under the
allocator's lock, before the range can be handed out again. Committed extents are never
written. So a worker that knows an extent held a shard's committed bytes at generation
``g`` (it committed the extent itself, or read ``g`` while the extent was pinned) may
read the slot, hash and copy the bytes, and read the slot again: ``g`` both times means
the extent was never freed in between, so the bytes it hashed and copied are the ones
committed; any other answer and the load pins, as before.

Slots are shared by hash: another extent's free may bump ours (that load then pins;
nothing else). Counters are uint64 and never wrap. The second read must not pass the
copy's loads: x86-64 guarantees it (loads are not reordered with older loads, and the
NodeStore's bump precedes every later write of the range, which reaches the writer
through a system call); elsewhere :data:`UNPINNED_READS` is False and every load pins.

Pure numpy: the NodeStore and the workers each wrap their own mapping of the region.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence

import numpy as np

MAX_TABLE_BYTES = 1 << 25  # 4M slots: 32 MiB of an arena of 2 GiB or more
_FIBONACCI = 0x9E3779B97F4A7C15  # spreads offsets that are multiples of a shard size
_MASK64 = (1 << 64) - 1

UNPINNED_READS = platform.machine().lower() in ("x86_64", "amd64")


def table_bytes(region_bytes: int) -> int:
    """Bytes at the end of a region of ``region_bytes`` that hold the table: a power of
    two, at most :data:`MAX_TABLE_BYTES` and 1/64 of the region."""
    budget = min(MAX_TABLE_BYTES, max(region_bytes // 64, 8))
    return 1 << (budget.bit_length() - 1)


class Generations:
    """The table at the end of ``region`` (a uint8 array of the whole mapping)."""

    def __init__(self, region: np.ndarray) -> None:
        self.nbytes = table_bytes(len(region))
        self.extents_bytes = len(region) - self.nbytes  # the region before the table
        self._counts = region[len(region) - self.nbytes :].view(np.uint64)
        self._shift = 64 - (len(self._counts).bit_length() - 1)
        self._words = memoryview(self._counts)  # read as ints: no numpy call per read

    def _slot(self, offset: int) -> int:
        return ((offset * _FIBONACCI) & _MASK64) >> self._shift  # the product's top bits

    def bump(self, offset: int) -> None:
        """NodeStore: the extent at ``offset`` is being freed (call before it can be
        allocated again; the caller serializes bumps, e.g. under the allocator's lock)."""
        self._counts[self._slot(offset)] += np.uint64(1)

    def read(self, offsets: Sequence[int]) -> list[int]:
        """Each extent's current generation (any thread, any process mapping the arena)."""
        return [self._words[self._slot(offset)] for offset in offsets]
