"""Leases and parking (a part of ChunkIndex).

A lease keeps a chunk an engine was told about (a HIT or PENDING) until it is loaded or
the lease expires. A leased or promoting unit met as a candidate is *parked*: out of
every heap until its last lease ends or is released, or its promotion is reported, so a
store that finds only protected units left is skipped without rescanning them.

Needs from the other parts: the candidate heaps (``_queue_everywhere``, on unparking).
"""

from __future__ import annotations

import heapq

from tierstore.control.index_model import ChunkId, Unit, UnitId
from tierstore.control.index_state import IndexState
from tierstore.keys import ChunkKey, Namespace, boundary_of


class LeasesMixin(IndexState):
    """Grants, extends, releases and expires leases; parks and wakes units."""

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, now: float, ttl_s: float
    ) -> None:
        """Keep chunks about to be loaded (pinned from prepare_load to complete_load)."""
        for key in keys:
            cid = ChunkId(namespace, key)
            if cid in self._chunks:
                self._lease(cid, holder, now + ttl_s)

    def _lease(self, cid: ChunkId, holder: str, until: float) -> None:
        """Lease ``cid`` to ``holder`` until ``until``. A lease made shorter (asked again
        with a shorter TTL) must wake its parked unit sooner: its wake-up was set by the
        old expiry, and the unit would stay out of every heap, unevictable, until then."""
        holders = self._leases[cid]
        before = holders.get(holder)
        holders[holder] = until
        if before is not None and until < before:  # rare: leave the hot path at once
            uid = UnitId(cid.namespace, boundary_of(cid.key))
            if uid in self._parked:
                heapq.heappush(self._wakeups, (max(holders.values()), next(self._tie), uid))

    def release(self, namespace: Namespace, keys: list[ChunkKey], holder: str) -> None:
        for key in keys:
            cid = ChunkId(namespace, key)
            holders = self._leases.get(cid)
            if holders is not None and holders.pop(holder, None) is not None:
                self._released(cid, holders)

    def release_holder(self, holder: str) -> None:
        """An engine went away: everything it held is evictable again."""
        for cid, holders in list(self._leases.items()):
            if holders.pop(holder, None) is not None:
                self._released(cid, holders)

    def _released(self, cid: ChunkId, holders: dict[str, float]) -> None:
        """A holder let go of ``cid``. A parked unit waits only for the leases left: its
        wake-up was set by the longest lease, which may have been this one."""
        uid = UnitId(cid.namespace, boundary_of(cid.key))
        if not holders:
            del self._leases[cid]
            self._unpark(uid)
        elif uid in self._parked:
            heapq.heappush(self._wakeups, (max(holders.values()), next(self._tie), uid))

    def _is_leased(self, cid: ChunkId, now: float) -> bool:
        holders = self._leases.get(cid)
        if not holders:
            return False
        for holder, expiry in list(holders.items()):
            if expiry <= now:
                del holders[holder]
        if not holders:
            del self._leases[cid]
            return False
        return True

    def is_leased(self, namespace: Namespace, key: ChunkKey, now: float) -> bool:
        return self._is_leased(ChunkId(namespace, key), now)

    def _pinned(self, uid: UnitId, unit: Unit, now: float) -> bool:
        return any(
            self._is_leased(ChunkId(uid.namespace, c.key), now) or s.promoting
            for c in unit.chunks
            for _, s in c.held()
        )

    def _park(self, uid: UnitId, unit: Unit) -> None:
        """Out of every queue until its leases end (or are released) or it is promoted."""
        self._parked.add(uid)
        ends = [
            max(holders.values())
            for c in unit.chunks
            if (holders := self._leases.get(ChunkId(uid.namespace, c.key)))
        ]
        if ends:
            heapq.heappush(self._wakeups, (max(ends), next(self._tie), uid))

    def _unpark(self, uid: UnitId) -> None:
        if uid in self._parked:
            self._parked.discard(uid)
            self._queue_everywhere(uid)

    def _wake(self, now: float) -> None:
        while self._wakeups and self._wakeups[0][0] <= now:
            self._unpark(heapq.heappop(self._wakeups)[2])
