"""The contract every tier engine honours."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np

from tierstore.errors import ChunkNotFoundError, TierFullError
from tierstore.keys import ShardId
from tierstore.wire import ShardMeta

__all__ = ["ShardMeta", "StoredShard", "Tier"]


@dataclass(frozen=True)
class StoredShard:
    meta: ShardMeta
    data: np.ndarray  # uint8, 1-D, len == meta.nbytes


class Tier(ABC):
    """A bounded store of shards.

    Thread-safe (the NodeStore loads on several threads while it stores and drops on
    another); methods never block on the network and hold no lock across payload I/O.
    Which shards to evict is not the tier's decision: the Evictor decides, and the
    NodeStore calls :meth:`delete`. A tier only refuses what does not fit.
    """

    name: str = "tier"  # in error messages
    # Whether put() copies the shard's bytes (else it keeps the array it is given).
    copies_on_put: bool = False

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._used_bytes = 0

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def _check_room(self, nbytes: int) -> None:
        if nbytes > self.free_bytes:
            raise TierFullError(
                f"{self.name} tier full: {nbytes} bytes asked, {self.free_bytes} free of "
                f"{self.capacity_bytes}"
            )

    @abstractmethod
    def put(self, shard_id: ShardId, shard: StoredShard) -> None:
        """Hold a shard. Raises TierFullError if it does not fit; replaces nothing."""

    def fill(self, shard_id: ShardId, meta: ShardMeta, write: Callable[[np.ndarray], None]) -> None:
        """Hold a shard whose bytes ``write`` puts into the buffer it is given (a disk
        promotion reads into it). This default writes a fresh array, then :meth:`put`;
        the arena tier hands ``write`` the shard's own extent instead."""
        self._check_room(meta.nbytes)
        data = np.empty(meta.nbytes, dtype=np.uint8)
        write(data)
        self.put(shard_id, StoredShard(meta, data))

    def find(self, shard_id: ShardId) -> StoredShard | None:
        """The shard, or None (one look-up: no drop can slip in between two)."""
        try:
            return self.get(shard_id)
        except ChunkNotFoundError:
            return None

    def reading(self) -> AbstractContextManager[None]:
        """While inside, bytes of shards :meth:`find` returned stay readable even if the
        shard is deleted meanwhile (the arena defers reusing their extents). A tier that
        never reuses memory needs nothing."""
        return nullcontext()

    @abstractmethod
    def get(self, shard_id: ShardId) -> StoredShard:
        """The shard. Raises ChunkNotFoundError if absent."""

    @abstractmethod
    def delete(self, shard_id: ShardId) -> int:
        """Forget a shard; returns the bytes freed (0 if it was absent)."""

    @abstractmethod
    def __contains__(self, shard_id: object) -> bool: ...

    @abstractmethod
    def items(self) -> Iterator[tuple[ShardId, ShardMeta]]:
        """Inventory: every shard held, with its metadata."""

    def __len__(self) -> int:
        return sum(1 for _ in self.items())

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes
