"""A TP group's ranks' commits of the same chunks, gathered so that their token
boundary is offered to the Evictor once (issue 28: admit chunks, not shards).

Each rank's worker commits its own shards in its own call; the NodeStore parks them
here until every rank's shard of every chunk at the boundary has come (or is already
held), then offers the whole unit in one admission. A unit some rank never completes
(that rank failed to store, or it lives on another node) is offered as it is once it
has waited :data:`GATHER_WAIT_S`, at the next commit: a partial unit is admitted, and a
later rank completes it (its lookups are a MISS until then, as they would be anyway).
A parked shard stays in the extent its worker filled, granted to that worker, and is
verified when it is adopted; nothing is copied.

Single-threaded: the NodeStore's control thread (its arena commits).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tierstore.keys import Namespace, ShardId, boundary_of
from tierstore.wire import ShardEntry, ShardOffer

# How long a partial unit waits for its other ranks. A TP group's ranks commit the same
# request within milliseconds of each other; this only bounds how long a unit some rank
# never completes holds its extents unindexed.
GATHER_WAIT_S = 1.0


@dataclass(frozen=True)
class Committed:
    """One checked entry of a worker's commit: where its bytes are, and whose."""

    holder: str
    namespace: Namespace
    rank: int
    world_size: int
    entry: ShardEntry

    @property
    def shard_id(self) -> ShardId:
        return ShardId(self.namespace, self.entry.key, self.rank)

    @property
    def offer(self) -> ShardOffer:
        e = self.entry
        return ShardOffer(
            self.namespace, e.key, self.rank, self.world_size, e.nbytes, e.parent, e.root
        )


@dataclass
class _Unit:
    since: float
    shards: dict[ShardId, Committed] = field(default_factory=dict)


class RankGather:
    def __init__(
        self, wait_s: float = GATHER_WAIT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._wait_s = wait_s
        self._clock = clock
        self._units: dict[tuple[Namespace, bytes], _Unit] = {}

    def add(self, items: list[Committed]) -> None:
        """Park ``items`` with the rest of their units (a shard committed again replaces
        its earlier entry)."""
        now = self._clock()
        for item in items:
            where = (item.namespace, boundary_of(item.entry.key))
            unit = self._units.get(where)
            if unit is None:
                unit = self._units[where] = _Unit(now)
            unit.shards[item.shard_id] = item

    def take(self, held: Callable[[ShardId], bool]) -> list[Committed]:
        """The parked shards to offer now, unit by unit: of every unit whose chunks each
        have all their ranks here or ``held`` already, and of every unit that waited
        :data:`GATHER_WAIT_S`. They are no longer parked (see :meth:`put_back`)."""
        deadline = self._clock() - self._wait_s
        ready = [
            where
            for where, unit in self._units.items()
            if unit.since <= deadline or _complete(unit, held)
        ]
        return [item for where in ready for item in self._units.pop(where).shards.values()]

    def put_back(self, items: list[Committed]) -> None:
        """Park again shards :meth:`take` gave out whose admission failed (the Evictor
        unreachable or restarted): they go with the next commit or flush."""
        self.add(items)

    def __len__(self) -> int:
        """Shards parked."""
        return sum(len(u.shards) for u in self._units.values())


def _complete(unit: _Unit, held: Callable[[ShardId], bool]) -> bool:
    for item in unit.shards.values():
        for rank in range(item.world_size):
            other = ShardId(item.namespace, item.entry.key, rank)
            if other not in unit.shards and not held(other):
                return False
    return True
