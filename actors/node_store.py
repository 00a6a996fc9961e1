"""NodeStore: one per node; owns that node's CPU tier and the bytes in it.

:class:`NodeStoreCore` holds all of the logic and no Ray; :class:`NodeStore` is the thin
actor around it. Shards arrive as one buffer per job (an ObjectRef the worker put); the
core copies each admitted shard out of it into memory this process owns, so the
producing worker may exit without taking a byte with it (ray-notes: a held ObjectRef
dies with its owner).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import ray

from tierstore.control.index import AdmitResult, ShardOffer
from tierstore.data.checksum import digest
from tierstore.data.tiers.base import ShardMeta, StoredShard
from tierstore.data.tiers.memory import MemoryTier
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError, TierFullError
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId

logger = logging.getLogger(__name__)


class ShardEntry(NamedTuple):
    """Where one shard sits in a job buffer, as the worker packed it."""

    key: ChunkKey
    offset: int
    nbytes: int
    digest: int
    slot_mask: int


@dataclass
class NodeStoreStats:
    stored_shards: int = 0
    skipped_shards: int = 0
    loaded_shards: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    dropped_shards: int = 0
    corrupt_on_store: int = 0


# admit(node, offers) -> AdmitResult; the Evictor's decision, passed in so the core is
# testable with an in-process ChunkIndex.
AdmitFn = Callable[[NodeId, list[ShardOffer]], AdmitResult]
# forget(node, shard_ids): admitted shards this node could not keep after all.
ForgetFn = Callable[[NodeId, list[ShardId]], None]


@dataclass
class NodeStoreCore:
    node_id: NodeId
    cpu: MemoryTier
    admit: AdmitFn
    forget: ForgetFn
    stats: NodeStoreStats = field(default_factory=NodeStoreStats)

    def store(
        self,
        namespace: Namespace,
        rank: int,
        world_size: int,
        entries: list[ShardEntry],
        buffer: np.ndarray,
    ) -> int:
        """Keep what the Evictor admits; returns the number of shards now held."""
        for entry in entries:
            if entry.offset < 0 or entry.offset + entry.nbytes > buffer.nbytes:
                raise ValueError(
                    f"shard at [{entry.offset}, {entry.offset + entry.nbytes}) lies outside "
                    f"the {buffer.nbytes}-byte job buffer"
                )
        offers = [ShardOffer(namespace, e.key, rank, world_size, e.nbytes) for e in entries]
        decision = self.admit(self.node_id, offers)
        self.drop(decision.drops.get(self.node_id, []))
        kept = 0
        lost: list[ShardId] = []
        for entry, accepted in zip(entries, decision.accepted, strict=True):
            if not accepted:
                self.stats.skipped_shards += 1
                continue
            data = np.array(buffer[entry.offset : entry.offset + entry.nbytes], copy=True)
            shard_id = ShardId(namespace, entry.key, rank)
            if digest(data) != entry.digest:
                self.stats.corrupt_on_store += 1
                logger.error("shard %s arrived corrupt; not stored", entry.key.hex())
                lost.append(shard_id)
                continue
            try:
                self.cpu.put(
                    shard_id,
                    StoredShard(ShardMeta(entry.nbytes, entry.digest, entry.slot_mask), data),
                )
            except TierFullError:
                # The Evictor's accounting and ours disagree: refuse rather than exceed the bound.
                logger.warning("CPU tier refused an admitted shard; skipping it", exc_info=True)
                self.stats.skipped_shards += 1
                lost.append(shard_id)
                continue
            kept += 1
            self.stats.stored_shards += 1
            self.stats.stored_bytes += entry.nbytes
        if lost:
            self.forget(self.node_id, lost)
        return kept

    def load(
        self, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> tuple[np.ndarray, list[ShardMeta]]:
        """The shards of ``keys``, back to back in one buffer, with their metadata."""
        shards = []
        for key in keys:
            shard_id = ShardId(namespace, key, rank)
            if shard_id not in self.cpu:
                raise ChunkNotFoundError(
                    f"node {self.node_id}: shard {key.hex()} rank {rank} is not held"
                )
            shards.append(self.cpu.get(shard_id))
        out = np.empty(sum(s.meta.nbytes for s in shards), dtype=np.uint8)
        offset = 0
        for shard in shards:
            out[offset : offset + shard.meta.nbytes] = shard.data
            offset += shard.meta.nbytes
        self.stats.loaded_shards += len(shards)
        self.stats.loaded_bytes += offset
        return out, [s.meta for s in shards]

    def drop(self, shard_ids: list[ShardId]) -> int:
        freed = 0
        for shard_id in shard_ids:
            freed += self.cpu.delete(ShardId(*shard_id))
            self.stats.dropped_shards += 1
        return freed

    def inventory(self) -> list[tuple[ShardId, int]]:
        return [(shard_id, meta.nbytes) for shard_id, meta in self.cpu.items()]

    def status(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "cpu": {
                "used_bytes": self.cpu.used_bytes,
                "capacity_bytes": self.cpu.capacity_bytes,
                "chunks": len(self.cpu),
            },
            "disk": {"used_bytes": 0, "capacity_bytes": 0, "chunks": 0},
            "stats": dict(vars(self.stats)),
        }


class NodeStore:
    """The actor: thin wrapper that talks Ray around :class:`NodeStoreCore`."""

    def __init__(self, node_id: str, cpu_bytes: int, evictor_name: str, namespace: str) -> None:
        self._evictor = ray.get_actor(evictor_name, namespace=namespace)
        ray.get(self._evictor.register_node.remote(node_id, cpu_bytes))
        self._core = NodeStoreCore(
            NodeId(node_id), MemoryTier(cpu_bytes), self._admit, self._forget
        )

    def _admit(self, node: NodeId, offers: list[ShardOffer]) -> AdmitResult:
        return AdmitResult(*ray.get(self._evictor.admit.remote(node, offers)))

    def _forget(self, node: NodeId, shard_ids: list[ShardId]) -> None:
        self._evictor.forget_shards.remote(node, shard_ids)

    def store(
        self,
        namespace: Namespace,
        rank: int,
        world_size: int,
        entries: list[ShardEntry],
        buffer_ref: list[ray.ObjectRef],
    ) -> int:
        # The ref comes wrapped in a list so Ray hands it over unresolved; get it here,
        # zero-copy, and let the core copy out what it keeps.
        buffer = ray.get(buffer_ref[0])
        return self._core.store(
            namespace, rank, world_size, [ShardEntry(*e) for e in entries], buffer
        )

    def load(
        self, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> tuple[list[ray.ObjectRef], list[ShardMeta]]:
        data, metas = self._core.load(namespace, rank, keys)
        # Returning the array would copy it per call; a ref in a list does not.
        return [ray.put(data)], metas

    def drop(self, shard_ids: list[ShardId]) -> int:
        return self._core.drop(shard_ids)

    def inventory(self) -> list[tuple[ShardId, int]]:
        return self._core.inventory()

    def status(self) -> dict[str, object]:
        return self._core.status()

    def corrupt_for_test(self, namespace: Namespace, key: ChunkKey, rank: int) -> None:
        """Flip one byte of a held shard (tests prove a corrupt chunk is never served)."""
        shard = self._core.cpu.get(ShardId(namespace, key, rank))
        shard.data[0] ^= 0xFF


__all__ = ["ChunkCorruptError", "NodeStore", "NodeStoreCore", "ShardEntry"]
