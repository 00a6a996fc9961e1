"""Hot-chunk replicas between NodeStores: pushing verified shards to a node that keeps
loading them, and keeping the ones another node pushed here.

:class:`ReplicaTransfers` is a part :class:`~tierstore.store.node_store.NodeStoreCore`
owns and delegates to: it is given the node's tiers, the Evictor and peer ports, the
counters and the core's ``drop`` (which takes the core's disk lock), and keeps no state
of its own. The control thread (the core's ``apply`` and ``accept_replicas``) and the
NodeStore's pull threads (``accept_replicas`` of lookup-time pulls); it holds no
lock across a peer or Evictor call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tierstore.data.checksum import digest
from tierstore.data.tiers.base import StoredShard, Tier
from tierstore.data.tiers.disk import DiskTier
from tierstore.errors import ChunkCorruptError, ChunkNotFoundError, TierFullError
from tierstore.keys import NodeId, ShardId
from tierstore.store.ports import EvictorPort, PeerPort
from tierstore.store.stats import StoreCounters
from tierstore.wire import ShardMeta

__all__ = ["Landed", "ReplicaTransfers"]

logger = logging.getLogger(__name__)


class Landed(NamedTuple):
    """Replica shards that reached this node: those kept, and those not (a checksum that
    failed, no room). The Evictor hears both (:meth:`ReplicaTransfers.report`)."""

    kept: list[ShardId]
    failed: list[ShardId]


@dataclass(frozen=True)
class ReplicaTransfers:
    """Replica pushes and receipts of one node.

    :meth:`push` sends shards the Evictor chose to replicate; :meth:`accept` keeps those
    another node sent. The Evictor hears what became of each shard (one-way: a push
    reports itself, a receipt through :meth:`report`), so its index never counts on a
    replica that is not there."""

    node_id: NodeId
    cpu: Tier
    disk: DiskTier | None
    evictor: EvictorPort
    peers: PeerPort | None  # None: pushes cannot be sent (reported failed)
    counters: StoreCounters
    drop: Callable[[list[ShardId]], int]  # forgets a corrupt copy in both tiers (the core's)

    def push(self, pushes: list[tuple[ShardId, NodeId]]) -> None:
        """Send each shard (verified first: a bad one is never spread) to its node."""
        by_node: dict[NodeId, list[ShardId]] = {}
        for shard_id, node in pushes:
            by_node.setdefault(node, []).append(shard_id)
        for node, shard_ids in by_node.items():
            with self.cpu.reading():  # no extent read here is reused until they are put
                self._push_to(node, shard_ids)

    def accept(self, shards: list[tuple[ShardId, ShardMeta]], views: list[np.ndarray]) -> Landed:
        """Keep replica shards another node sent (``views``: one array per shard, maybe
        read-only views of the fetched object), verified; which were kept is for
        :meth:`report`."""
        done: list[ShardId] = []
        failed: list[ShardId] = []
        if len(views) != len(shards):
            logger.warning("%d arrays for %d replica shards; none kept", len(views), len(shards))
            views = []
        for i, (shard_id, meta) in enumerate(shards):
            data = views[i] if i < len(views) else np.empty(0, dtype=np.uint8)
            if not self.cpu.copies_on_put:
                data = np.array(data, copy=True)
            if data.nbytes != meta.nbytes or digest(data) != meta.digest:
                self.counters.add(corrupt_on_store=1)
                failed.append(shard_id)
                continue
            try:
                self.cpu.put(shard_id, StoredShard(meta, data))
            except TierFullError:
                logger.warning("no CPU room for replica %s", shard_id.key.hex(), exc_info=True)
                failed.append(shard_id)
                continue
            self.counters.add(replicas_received=1)
            done.append(shard_id)
        return Landed(done, failed)

    def report(self, landed: Landed) -> None:
        """Tell the Evictor which replica shards this node kept and which not (one-way)."""
        self.evictor.replicated(self.node_id, landed.kept, landed.failed)

    def _push_to(self, node: NodeId, shard_ids: list[ShardId]) -> None:
        sent: list[tuple[ShardId, StoredShard]] = []
        failed: list[ShardId] = []
        for shard_id in shard_ids:
            shard = self._readable(shard_id)
            if shard is None or self.peers is None:
                failed.append(shard_id)
            else:
                sent.append((shard_id, shard))
        if sent and self.peers is not None:
            # The extents themselves: the port copies them out once (into the object store).
            metas = [(sid, s.meta) for sid, s in sent]
            self.peers.accept_replicas(node, metas, [s.data for _, s in sent])
            self.counters.add(replicas_sent=len(sent))
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
        except ChunkNotFoundError:
            return None  # dropped meanwhile
        except ChunkCorruptError:
            logger.warning("not replicating corrupt %s", shard_id.key.hex(), exc_info=True)
            self.counters.add(corrupt_before_hit=1)
            self.drop([shard_id])
            self.evictor.forget_shards(self.node_id, [shard_id])
        return None
