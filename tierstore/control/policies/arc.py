"""Adaptive Replacement Cache (Megiddo & Modha, 2003) as an eviction order.

``t1`` holds units seen once, ``t2`` units hit again; ``b1``/``b2`` remember recently
evicted ones. A hit on a ghost in ``b1`` means ``t1`` was too small: the target ``p``
grows; one in ``b2`` shrinks it. Candidates come from ``t1`` first while it is over
target, so a scan of one-off prefixes cannot flush the prefixes that are reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from itertools import count

from typing_extensions import override

from tierstore.control.policies.base import EvictionPolicy

_GHOSTS_MAX = 100_000  # remembered evictions per ghost list; bounds memory
T1, T2 = 0, 1  # segments


class ARCPolicy(EvictionPolicy):
    def __init__(self) -> None:
        # unit -> rank (the tick it entered or was last touched in its list); plain dicts
        # keep that order. Ghosts are popped from the front, which OrderedDict does in O(1).
        self._t1: dict[Hashable, int] = {}
        self._t2: dict[Hashable, int] = {}
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._clock = count()
        self.p = 0.0  # target size of t1

    @override
    def insert(self, unit: Hashable) -> None:
        if unit in self._b1:  # evicted too early from t1: favour recency
            self.p += max(1.0, len(self._b2) / max(len(self._b1), 1))
            del self._b1[unit]
            self._t2[unit] = next(self._clock)
        elif unit in self._b2:  # evicted too early from t2: favour frequency
            self.p = max(0.0, self.p - max(1.0, len(self._b1) / max(len(self._b2), 1)))
            del self._b2[unit]
            self._t2[unit] = next(self._clock)
        else:
            self._t1[unit] = next(self._clock)
        self.p = min(self.p, float(len(self._t1) + len(self._t2)))

    @override
    def touch(self, unit: Hashable) -> None:
        if unit in self._t1:
            del self._t1[unit]
            self._t2[unit] = next(self._clock)
        elif unit in self._t2:
            del self._t2[unit]
            self._t2[unit] = next(self._clock)

    @override
    def remove(self, unit: Hashable) -> None:
        for live, ghost in ((self._t1, self._b1), (self._t2, self._b2)):
            if unit in live:
                del live[unit]
                ghost[unit] = None
                if len(ghost) > _GHOSTS_MAX:
                    ghost.popitem(last=False)
                return

    @override
    def position(self, unit: Hashable) -> tuple[int, int] | None:
        rank = self._t1.get(unit)
        if rank is not None:
            return (T1, rank)
        rank = self._t2.get(unit)
        return None if rank is None else (T2, rank)

    @override
    def segment_order(self) -> Sequence[int]:
        return (T1, T2) if len(self._t1) > self.p else (T2, T1)

    @override
    def candidates(self) -> Iterator[Hashable]:
        lists = {T1: self._t1, T2: self._t2}
        first, second = (lists[s] for s in self.segment_order())
        return iter(list(first) + list(second))
