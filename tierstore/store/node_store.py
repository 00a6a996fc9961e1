"""NodeStore: one per node; owns that node's CPU and disk tiers and the bytes in them.

:class:`NodeStoreCore` holds all of the logic and no Ray; the actor
(``tierstore.actors.node_store_actor``) is a thin shell around it. Shards arrive as one
buffer per job (an ObjectRef the worker put); the core copies each admitted shard out of
it into memory this process owns, so the producing worker may exit without taking a
byte with it (ray-notes: a held ObjectRef dies with its owner). What to keep, demote,
promote or drop is the Evictor's decision; the core carries it out and reports what
failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from tierstore.control.index import NodeActions, ShardOffer
from tierstore.data.checksum import digest
from tierstore.data.tiers.base import ShardMeta, StoredShard, Tier
from tierstore.data.tiers.disk import DiskTier
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError, TierFullError
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName
from tierstore.store.ports import EvictorPort, PeerPort

__all__ = ["EvictorPort", "NodeStoreCore", "NodeStoreStats", "PeerPort", "ShardEntry"]

logger = logging.getLogger(__name__)


class ShardEntry(NamedTuple):
    """Where one shard sits in a job buffer, as the worker packed it."""

    key: ChunkKey
    offset: int
    nbytes: int
    digest: int
    slot_mask: int
    parent: bytes | None = None


@dataclass
class NodeStoreStats:
    stored_shards: int = 0
    skipped_shards: int = 0
    loaded_shards: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    dropped_shards: int = 0
    demoted_shards: int = 0
    promoted_shards: int = 0
    replicas_sent: int = 0  # shards pushed to nodes that kept loading them
    replicas_received: int = 0
    failed_demotions: int = 0
    corrupt_on_store: int = 0
    corrupt_before_hit: int = 0
    corrupt_after_hit: int = 0


def _tier_status(tier: Tier | None) -> dict[str, int]:
    if tier is None:
        return {"used_bytes": 0, "capacity_bytes": 0, "chunks": 0}
    return {
        "used_bytes": tier.used_bytes,
        "capacity_bytes": tier.capacity_bytes,
        "chunks": len(tier),
    }


@dataclass
class NodeStoreCore:
    node_id: NodeId
    cpu: Tier  # ArenaTier in the actor (shared memory); MemoryTier in Ray-free tests
    disk: DiskTier | None
    evictor: EvictorPort
    # Runs actions later (the actor queues them to itself, after the store is
    # acknowledged, so write-through never delays a store); default: right away.
    defer: Callable[[NodeActions], None] | None = None
    peers: PeerPort | None = None  # None: replicas cannot be pushed (reported failed)
    stats: NodeStoreStats = field(default_factory=NodeStoreStats)

    def __post_init__(self) -> None:
        if self.defer is None:
            self.defer = self.apply
        if self.disk is not None:  # corrupt files found (and removed) while re-indexing
            self.stats.corrupt_before_hit += self.disk.corrupt_files_removed

    # ---- start-up ----------------------------------------------------------------------
    def register_inventory(self, after_evictor_restart: bool = False) -> int:
        """Offer what this node holds to the Evictor; drop what it refuses.

        ``after_evictor_restart``: HITs granted by the lost index may still be loading,
        so the Evictor keeps these chunks leased for a while.
        """
        held = [
            (_offer(shard_id, meta), TierName.DISK)
            for shard_id, meta in (self.disk.items() if self.disk else [])
        ] + [(_offer(shard_id, meta), TierName.CPU) for shard_id, meta in self.cpu.items()]
        if not held:
            return 0
        accepted, actions = self.evictor.restore(self.node_id, held, after_evictor_restart)
        self.apply(actions)
        return sum(accepted)

    # ---- stores ------------------------------------------------------------------------
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
        offers = [
            ShardOffer(namespace, e.key, rank, world_size, e.nbytes, e.parent) for e in entries
        ]
        accepted, persist = self.admit(offers)
        kept = 0
        lost: list[ShardId] = []
        for entry, ok in zip(entries, accepted, strict=True):
            if not ok:
                self.stats.skipped_shards += 1
                continue
            shard_id = ShardId(namespace, entry.key, rank)
            if not self._keep(shard_id, entry, world_size, buffer):
                lost.append(shard_id)
                continue
            kept += 1
            self.stats.stored_shards += 1
            self.stats.stored_bytes += entry.nbytes
        self.settle_store(lost, persist)
        return kept

    def admit(self, offers: list[ShardOffer]) -> tuple[list[bool], list[ShardId]]:
        """The Evictor's admission of new shards; the room it makes is made now. Returns
        which are accepted and the write-through to run once they are held."""
        decision = self.evictor.admit(self.node_id, offers)
        own = decision.actions.get(self.node_id, NodeActions())
        self.apply(NodeActions(drop=own.drop, demote=own.demote, promote=own.promote))
        return list(decision.accepted), list(own.persist)

    def settle_store(self, lost: list[ShardId], persist: list[ShardId]) -> None:
        """After a store: forget what was admitted but not kept; queue the write-through."""
        if lost:
            self.evictor.forget_shards(self.node_id, lost)
        if persist:
            assert self.defer is not None
            self.defer(NodeActions(persist=persist))

    def _keep(
        self, shard_id: ShardId, entry: ShardEntry, world_size: int, buffer: np.ndarray
    ) -> bool:
        """Verify one shard of a job buffer and hold it (one copy, into the CPU tier)."""
        data = buffer[entry.offset : entry.offset + entry.nbytes]
        if not self.cpu.copies_on_put:  # the tier would keep a view of the worker's buffer
            data = np.array(data, copy=True)
        if digest(data) != entry.digest:
            self.stats.corrupt_on_store += 1
            logger.error("shard %s arrived corrupt; not stored", entry.key.hex())
            return False
        meta = ShardMeta(entry.nbytes, entry.digest, entry.slot_mask, world_size, entry.parent)
        try:
            self.cpu.put(shard_id, StoredShard(meta, data))
        except TierFullError:
            logger.warning("CPU tier refused an admitted shard; skipping it", exc_info=True)
            self.stats.skipped_shards += 1
            return False
        return True

    # ---- the Evictor's decisions ---------------------------------------------------------
    def apply(self, actions: NodeActions) -> None:
        """Drop, demote, promote, persist, push: each step makes the room the next one needs."""
        self.drop(actions.drop)
        lost = [s for s in map(_shard_id, actions.demote) if not self._demote(s)]
        done, failed = [], []
        for shard_id in map(_shard_id, actions.promote):
            (done if self._promote(shard_id) else failed).append(shard_id)
        lost += [s for s in map(_shard_id, actions.persist) if not self._persist(s)]
        if lost:
            self.evictor.forget_shards(self.node_id, lost)
        if done or failed:
            self.evictor.promoted(self.node_id, done, failed)
        self._push(actions.push)

    def drop(self, shard_ids: list[ShardId]) -> int:
        freed = 0
        for shard_id in map(_shard_id, shard_ids):
            freed += self.cpu.delete(shard_id)
            if self.disk is not None:
                freed += self.disk.delete(shard_id)
            self.stats.dropped_shards += 1
        return freed

    def _write_to_disk(self, shard_id: ShardId) -> bool:
        """Copy a memory shard to disk (once); False if it cannot be written."""
        if self.disk is None:
            return False
        if shard_id in self.disk:
            return True
        if shard_id not in self.cpu:
            return False
        try:
            self.disk.put(shard_id, self.cpu.get(shard_id))
        except (TierFullError, ValueError):
            logger.warning("writing %s to disk failed", shard_id.key.hex(), exc_info=True)
            self.stats.failed_demotions += 1
            return False
        return True

    def _demote(self, shard_id: ShardId) -> bool:
        """Free the memory copy; written first if it is not on disk yet."""
        written = self._write_to_disk(shard_id)
        self.cpu.delete(shard_id)
        if written:
            self.stats.demoted_shards += 1
        return written

    def _persist(self, shard_id: ShardId) -> bool:
        """Write-through after a store: the memory copy stays."""
        if self._write_to_disk(shard_id):
            return True
        self.drop([shard_id])  # the index expected a disk copy: keep the two in step
        return False

    def _promote(self, shard_id: ShardId) -> bool:
        """Disk -> CPU, verified: a corrupt or truncated file becomes a miss, never a HIT."""
        if shard_id in self.cpu:
            return True
        if self.disk is None or shard_id not in self.disk:
            return False
        try:
            disk = self.disk
            # Read straight into the CPU tier's extent, verified there; the disk copy
            # stays, so a later demotion is free.
            self.cpu.fill(shard_id, disk.meta(shard_id), lambda out: disk.read_into(shard_id, out))
        except ChunkCorruptError:
            logger.warning(
                "corrupt chunk file for %s removed; it will be recomputed",
                shard_id.key.hex(),
                exc_info=True,
            )
            self.stats.corrupt_before_hit += 1
            return False
        except TierFullError:
            logger.warning("no CPU room to promote %s", shard_id.key.hex(), exc_info=True)
            return False
        self.stats.promoted_shards += 1
        return True

    # ---- replicas ----------------------------------------------------------------------
    def _push(self, pushes: list[tuple[ShardId, NodeId]]) -> None:
        """Send each shard (verified first: a bad one is never spread) to its node."""
        by_node: dict[NodeId, list[ShardId]] = {}
        for shard_id, node in pushes:
            by_node.setdefault(NodeId(node), []).append(_shard_id(shard_id))
        for node, shard_ids in by_node.items():
            sent: list[tuple[ShardId, StoredShard]] = []
            failed: list[ShardId] = []
            for shard_id in shard_ids:
                shard = self._readable(shard_id)
                if shard is None or self.peers is None:
                    failed.append(shard_id)
                else:
                    sent.append((shard_id, shard))
            if sent:
                assert self.peers is not None
                buffer = np.concatenate([s.data for _, s in sent])
                self.peers.accept_replicas(node, [(sid, s.meta) for sid, s in sent], buffer)
                self.stats.replicas_sent += len(sent)
            if failed:
                self.evictor.replicated(node, [], failed)

    def _readable(self, shard_id: ShardId) -> StoredShard | None:
        """The memory or disk copy, if it passes its checksum; a bad one is forgotten."""
        try:
            if shard_id in self.cpu:
                shard = self.cpu.get(shard_id)
                if digest(shard.data) != shard.meta.digest:
                    raise ChunkCorruptError(f"chunk {shard_id.key.hex()}: checksum mismatch")
                return shard
            if self.disk is not None and shard_id in self.disk:
                return self.disk.get(shard_id)  # verifies
        except ChunkCorruptError:
            logger.warning("not replicating corrupt %s", shard_id.key.hex(), exc_info=True)
            self.stats.corrupt_before_hit += 1
            self.drop([shard_id])
            self.evictor.forget_shards(self.node_id, [shard_id])
        return None

    def accept_replicas(self, shards: list[tuple[ShardId, ShardMeta]], buffer: np.ndarray) -> None:
        """Keep replica shards another node pushed, verified; tell the Evictor which."""
        done: list[ShardId] = []
        failed: list[ShardId] = []
        offset = 0
        for shard_id, meta in shards:
            shard_id = _shard_id(shard_id)
            data = buffer[offset : offset + meta.nbytes]
            if not self.cpu.copies_on_put:
                data = np.array(data, copy=True)
            offset += meta.nbytes
            if data.nbytes != meta.nbytes or digest(data) != meta.digest:
                self.stats.corrupt_on_store += 1
                failed.append(shard_id)
                continue
            try:
                self.cpu.put(shard_id, StoredShard(meta, data))
            except TierFullError:
                logger.warning("no CPU room for replica %s", shard_id.key.hex(), exc_info=True)
                failed.append(shard_id)
                continue
            self.stats.replicas_received += 1
            done.append(shard_id)
        self.evictor.replicated(self.node_id, done, failed)

    # ---- loads -------------------------------------------------------------------------
    def load(
        self, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> tuple[np.ndarray, list[ShardMeta]]:
        """The shards of ``keys``, back to back in one buffer, each verified first."""
        shards = [self._held(ShardId(namespace, key, rank)) for key in keys]
        out = np.empty(sum(s.meta.nbytes for s in shards), dtype=np.uint8)
        offset = 0
        for shard in shards:
            out[offset : offset + shard.meta.nbytes] = shard.data
            offset += shard.meta.nbytes
        self.stats.loaded_shards += len(shards)
        self.stats.loaded_bytes += offset
        return out, [s.meta for s in shards]

    def _held(self, shard_id: ShardId) -> StoredShard:
        if shard_id in self.cpu:
            shard = self.cpu.get(shard_id)
            if digest(shard.data) != shard.meta.digest:
                # The bytes changed in memory after the HIT was promised: fail the load.
                self.stats.corrupt_after_hit += 1
                self.cpu.delete(shard_id)
                self.evictor.report_corrupt_after_hit(self.node_id, [shard_id])
                raise ChunkCorruptError(
                    f"node {self.node_id}: chunk {shard_id.key.hex()} rank {shard_id.rank} "
                    "failed its checksum in memory"
                )
            return shard
        if self.disk is not None and shard_id in self.disk:  # not promoted yet: still safe
            try:
                return self.disk.get(shard_id)
            except ChunkCorruptError:
                self.stats.corrupt_after_hit += 1
                self.evictor.report_corrupt_after_hit(self.node_id, [shard_id])
                raise
        raise ChunkNotFoundError(
            f"node {self.node_id}: chunk {shard_id.key.hex()} rank {shard_id.rank} is not held"
        )

    # ---- introspection -------------------------------------------------------------------
    def inventory(self) -> set[tuple[ShardId, TierName]]:
        """Every copy this node holds."""
        held = {(s, TierName.CPU) for s, _ in self.cpu.items()}
        if self.disk is not None:
            held |= {(s, TierName.DISK) for s, _ in self.disk.items()}
        return held

    def status(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "cpu": _tier_status(self.cpu),
            "disk": _tier_status(self.disk),
            "stats": dict(vars(self.stats)),
        }

    def corrupt_in_memory(self, shard_id: ShardId) -> None:
        """Flip one byte of a shard held in memory (tests prove it is never served)."""
        self.cpu.get(_shard_id(shard_id)).data[0] ^= 0xFF


def _shard_id(value: ShardId | tuple) -> ShardId:  # type: ignore[type-arg]
    """Ray hands NamedTuples back as tuples when nested; restore the type."""
    namespace, key, rank = value
    return ShardId(Namespace(namespace), ChunkKey(key), int(rank))


def _offer(shard_id: ShardId, meta: ShardMeta) -> ShardOffer:
    return ShardOffer(
        shard_id.namespace, shard_id.key, shard_id.rank, meta.world_size, meta.nbytes, meta.parent
    )
