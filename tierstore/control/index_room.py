"""Making room in a node's tiers (a part of ChunkIndex).

CPU room is made by dropping the node's replicas first, then by demoting units to disk,
then by dropping whole units, tail first; disk room only by dropping disk-only tails. A
store that finds only its own (protected) units left demotes those to disk as a last
resort, so a prompt larger than the CPU tier is stored whole.
Past the high watermark, CPU copies are demoted down to the low one.

Needs from the other parts: the candidate walk (``_walk``), the tree (``_gain``,
``_lose``, ``_drop_unit``) and the replicas (``_evict_replicas``).
"""

from __future__ import annotations

from collections.abc import Callable

from tierstore.control.index_model import Actions, UnitId
from tierstore.control.index_state import IndexState
from tierstore.keys import NodeId, ShardId, TierName


class RoomMixin(IndexState):
    """Frees bytes on one node and tier, in policy order, within the tree rules."""

    def _make_room(
        self,
        node: NodeId,
        tier: TierName,
        nbytes: int,
        protected: set[UnitId],
        now: float,
        free_one: Callable[[UnitId], bool],
    ) -> bool:
        account = self._nodes[node][tier]
        if nbytes > account.capacity_bytes:
            return False

        def fits() -> bool:
            return account.used_bytes + nbytes <= account.capacity_bytes

        return self._walk(node, tier, protected, now, fits, free_one)

    def _make_cpu_room(
        self, node: NodeId, nbytes: int, protected: set[UnitId], now: float, actions: Actions
    ) -> bool:
        if self._fits(node, TierName.CPU, nbytes):
            return True
        if self._evict_replicas(node, lambda: self._fits(node, TierName.CPU, nbytes), now, actions):
            return True

        def free_one(uid: UnitId) -> bool:
            if self._demote(uid, node, protected, now, actions):
                return True
            if self._units[uid].children:
                return False
            self._drop_unit(uid, actions)  # a tail: safe to drop everywhere
            self.stats.evicted_chunks += 1
            return True

        return self._make_room(node, TierName.CPU, nbytes, protected, now, free_one)

    def _demote_for_store(
        self,
        node: NodeId,
        nbytes: int,
        own: UnitId,
        protected: set[UnitId],
        now: float,
        actions: Actions,
    ) -> bool:
        """A store's last resort: make CPU room by demoting even ``protected`` units (the
        batch's own, their parents) to disk, never dropping one.

        Protection is against dropping: a dropped parent would leave the new chunks
        unreachable. A demoted one stays indexed and is loaded from disk, so a prompt
        larger than the whole CPU tier is still stored whole, its earlier chunks going
        to disk as later ones arrive. ``own``: the offer's unit, never demoted for itself.
        The NodeStore writes a demoted shard of the same batch straight to disk.
        """
        if self._nodes[node][TierName.DISK].capacity_bytes == 0:
            return False
        return self._make_room(
            node,
            TierName.CPU,
            nbytes,
            {own},
            now,
            lambda uid: self._demote(uid, node, protected, now, actions),
        )

    def _demote(
        self, uid: UnitId, node: NodeId, protected: set[UnitId], now: float, actions: Actions
    ) -> bool:
        """Free ``uid``'s CPU copies on ``node``, writing those not on disk yet."""
        unit = self._units[uid]
        moving = [(c, rank, s) for c, rank, s in unit.shards() if s.node == node and s.cpu]
        to_write = sum(s.nbytes for _, _, s in moving if not s.disk)
        if to_write and not self._make_disk_room(node, to_write, protected | {uid}, now, actions):
            return False
        for chunk, rank, shard in moving:
            self._gain(uid, unit, shard, TierName.DISK)
            self._lose(uid, unit, shard, TierName.CPU)
            actions[node].demote.append(ShardId(uid.namespace, chunk.key, rank))
            self.stats.demoted_shards += 1
        return True

    def _make_disk_room(
        self, node: NodeId, nbytes: int, protected: set[UnitId], now: float, actions: Actions
    ) -> bool:
        """Drop disk-only tails; a unit with a copy in memory is never dropped for disk room."""
        if self._fits(node, TierName.DISK, nbytes):
            return True

        def free_one(uid: UnitId) -> bool:
            self._drop_unit(uid, actions)
            self.stats.evicted_chunks += 1
            return True

        return self._make_room(node, TierName.DISK, nbytes, protected, now, free_one)

    def _demote_to_watermark(
        self, node: NodeId, protected: set[UnitId], now: float, actions: Actions
    ) -> None:
        tiers = self._nodes[node]
        cpu = tiers[TierName.CPU]
        if tiers[TierName.DISK].capacity_bytes == 0:
            return
        if cpu.used_bytes <= self._watermarks.high * cpu.capacity_bytes:
            return
        target = self._watermarks.low * cpu.capacity_bytes
        if self._evict_replicas(node, lambda: cpu.used_bytes <= target, now, actions):
            return
        self._walk(
            node,
            TierName.CPU,
            protected,
            now,
            lambda: cpu.used_bytes <= target,
            lambda uid: self._demote(uid, node, protected, now, actions),
        )
