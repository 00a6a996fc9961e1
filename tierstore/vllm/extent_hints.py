"""Where a worker last saw each shard in its node's arena: lets a same-node load read
the extents without pinning them first.

A hint is only a guess (the shard may have been evicted since, its extent freed and
written again): the load trusts it only if the extent's generation is the hinted one
before the copy and after it, and the digest matches
(:mod:`tierstore.data.arena.generations`); otherwise it forgets the hint and pins.

Threads: any; one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from tierstore.data.tiers.base import ShardMeta
from tierstore.keys import ChunkKey, Namespace

# Bounded: an engine may run for weeks; a forgotten hint only costs one overlap.
MAX_HINTS = 1 << 16

_Key = tuple[str, Namespace, ChunkKey]  # (arena epoch, namespace, key)


class ExtentHint(NamedTuple):
    offset: int
    meta: ShardMeta  # the committed shard's (its digest, bytes, slots)
    generation: int  # the extent's generation while it held those bytes


class ExtentHints:
    def __init__(self, max_hints: int = MAX_HINTS) -> None:
        self._extents: OrderedDict[_Key, ExtentHint] = OrderedDict()
        self._max = max_hints
        self._lock = threading.Lock()

    def remember(
        self,
        epoch: str,
        namespace: Namespace,
        keys: Sequence[ChunkKey],
        hints: Sequence[ExtentHint],
    ) -> None:
        """``hints``: where each key's shard of this worker's rank is."""
        with self._lock:
            for key, hint in zip(keys, hints, strict=True):
                self._extents[(epoch, namespace, key)] = hint
                self._extents.move_to_end((epoch, namespace, key))
            while len(self._extents) > self._max:
                self._extents.popitem(last=False)

    def extents(
        self, epoch: str, namespace: Namespace, keys: Sequence[ChunkKey]
    ) -> list[ExtentHint] | None:
        """Every key's last known extent in this arena, or None if one is unknown."""
        with self._lock:
            found = [self._extents.get((epoch, namespace, key)) for key in keys]
        return None if None in found else found  # type: ignore[return-value]

    def forget(self, epoch: str, namespace: Namespace, keys: Sequence[ChunkKey]) -> None:
        """The hints failed their check (the extents moved on): the next load pins."""
        with self._lock:
            for key in keys:
                self._extents.pop((epoch, namespace, key), None)
