"""The candidate heaps: finding what to evict without walking every unit (a part of
ChunkIndex).

Each (node, tier, policy segment) has a heap of ``(rank, unit)`` entries
(:class:`CandidateQueue`). Entries are checked when popped, never removed eagerly; a
unit is pushed again whenever it may have become evictable somewhere. A walk pops
candidates in policy order and hands each to a caller's ``free_one``.

Needs from the other parts: leases and parking (``_pinned``, ``_park``, ``_wake``,
``_parked``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from tierstore.control.index_model import Unit, UnitId
from tierstore.control.index_state import IndexState
from tierstore.keys import NodeId, TierName

_COMPACT_MIN = 1024  # a candidate heap is never compacted below this many entries


@dataclass(slots=True)
class CandidateQueue:
    """Candidates of one (node, tier, policy segment): a heap of ``(rank, unit)``.

    Entries are checked when popped, never removed eagerly: an entry may be stale (the
    unit was touched, moved, dropped, or is no longer evictable there). Whenever a unit
    may have become evictable somewhere, it is pushed again; the heap is compacted once
    it doubles, so upkeep stays O(log n) amortized per change.
    """

    heap: list[tuple[int, UnitId]] = field(default_factory=list)
    compact_at: int = _COMPACT_MIN


class CandidatesMixin(IndexState):
    """Keeps the heaps current and pops the next unit that may go."""

    def _push(self, uid: UnitId, node: NodeId, tier: TierName) -> None:
        position = self._policy.position(uid)
        if position is None or uid in self._dying:
            return
        segment, rank = position
        queue = self._queues.get((node, tier, segment))
        if queue is None:
            queue = self._queues[(node, tier, segment)] = CandidateQueue()
        heapq.heappush(queue.heap, (rank, uid))
        if len(queue.heap) > queue.compact_at:
            self._compact(node, tier, segment, queue)

    def _queue_tier(self, uid: UnitId, unit: Unit, tier: TierName) -> None:
        if uid in self._dying:
            return
        for node in {s.node for _, _, s in unit.shards() if s.has(tier)}:
            self._push(uid, node, tier)

    def _queue_everywhere(self, uid: UnitId) -> None:
        unit = self._units.get(uid)
        if unit is not None:
            for tier in TierName:
                self._queue_tier(uid, unit, tier)

    def _touch(self, uid: UnitId) -> None:
        before = self._policy.position(uid)
        self._policy.touch(uid)
        after = self._policy.position(uid)
        # Within a segment, a stale queue entry is re-ranked when popped; a unit that
        # changed segment must be queued in its new one now.
        if before is not None and after is not None and before[0] != after[0]:
            self._queue_everywhere(uid)

    def _compact(self, node: NodeId, tier: TierName, segment: int, queue: CandidateQueue) -> None:
        """Keep one current entry per unit still evictable here; parked units come back
        when unparked."""
        ranks: dict[UnitId, int] = {}
        for _, uid in queue.heap:
            unit = self._units.get(uid)
            position = self._policy.position(uid)
            if unit is None or position is None or position[0] != segment:
                continue
            if uid not in self._parked and self._evictable_from(uid, unit, node, tier):
                ranks[uid] = position[1]
        queue.heap = [(rank, uid) for uid, rank in ranks.items()]
        heapq.heapify(queue.heap)
        queue.compact_at = max(_COMPACT_MIN, 2 * len(queue.heap))

    def _evictable_from(self, uid: UnitId, unit: Unit, node: NodeId, tier: TierName) -> bool:
        """The tree rules: CPU copies go (demoted, or dropped with the unit) only when no
        child has a CPU copy; disk copies only from disk-only tails."""
        if tier is TierName.CPU:
            if unit.cpu_children:
                return False
        elif unit.children or unit.cpu_copies:
            return False
        return any(s.node == node and s.has(tier) for _, _, s in unit.shards())

    def _next_candidate(
        self,
        node: NodeId,
        tier: TierName,
        protected: set[UnitId],
        now: float,
        aside: dict[UnitId, None],
    ) -> UnitId | None:
        """The first unit in policy order whose ``tier`` copies on ``node`` may go now.

        Pops it; protected units go ``aside`` (queued again after this walk), leased and
        promoting ones are parked.
        """
        for segment in self._policy.segment_order():
            queue = self._queues.get((node, tier, segment))
            while queue is not None and queue.heap:
                rank, uid = heapq.heappop(queue.heap)
                unit = self._units.get(uid)
                if unit is None or uid in aside:
                    continue
                position = self._policy.position(uid)
                if position != (segment, rank):
                    if position is not None and position[0] == segment:
                        heapq.heappush(queue.heap, (position[1], uid))  # touched since
                    continue
                if not self._evictable_from(uid, unit, node, tier):
                    continue  # queued again by whatever makes it evictable
                if uid in protected:
                    aside[uid] = None
                elif self._pinned(uid, unit, now):
                    self._park(uid, unit)
                else:
                    return uid
        return None

    def _walk(
        self,
        node: NodeId,
        tier: TierName,
        protected: set[UnitId],
        now: float,
        done: Callable[[], bool],
        free_one: Callable[[UnitId], bool],
    ) -> bool:
        """Let ``free_one`` free candidates in policy order until ``done``; a unit it
        cannot free is passed over for the rest of this walk."""
        if done():
            return True
        self._wake(now)
        aside: dict[UnitId, None] = {}
        try:
            while not done():
                uid = self._next_candidate(node, tier, protected, now, aside)
                if uid is None:
                    return False
                if not free_one(uid):
                    aside[uid] = None
            return True
        finally:
            for uid in aside:
                if uid in self._units:
                    self._push(uid, node, tier)
