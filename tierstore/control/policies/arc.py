"""Adaptive Replacement Cache (Megiddo & Modha, 2003) as an eviction order.

``t1`` holds units seen once, ``t2`` units hit again; ``b1``/``b2`` remember recently
evicted ones. A hit on a ghost in ``b1`` means ``t1`` was too small: the target ``p``
grows; one in ``b2`` shrinks it. Candidates come from ``t1`` first while it is over
target, so a scan of one-off prefixes cannot flush the prefixes that are reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from typing_extensions import override

from tierstore.control.policies.base import EvictionPolicy

_GHOSTS_MAX = 100_000  # remembered evictions per ghost list; bounds memory


class ARCPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self.p = 0.0  # target size of t1

    @override
    def insert(self, chunk: Hashable) -> None:
        if chunk in self._b1:  # evicted too early from t1: favour recency
            self.p += max(1.0, len(self._b2) / max(len(self._b1), 1))
            del self._b1[chunk]
            self._t2[chunk] = None
        elif chunk in self._b2:  # evicted too early from t2: favour frequency
            self.p = max(0.0, self.p - max(1.0, len(self._b1) / max(len(self._b2), 1)))
            del self._b2[chunk]
            self._t2[chunk] = None
        else:
            self._t1[chunk] = None
        self.p = min(self.p, float(len(self._t1) + len(self._t2)))

    @override
    def touch(self, chunk: Hashable) -> None:
        if chunk in self._t1:
            del self._t1[chunk]
            self._t2[chunk] = None
        elif chunk in self._t2:
            self._t2.move_to_end(chunk)

    @override
    def remove(self, chunk: Hashable) -> None:
        for live, ghost in ((self._t1, self._b1), (self._t2, self._b2)):
            if chunk in live:
                del live[chunk]
                ghost[chunk] = None
                if len(ghost) > _GHOSTS_MAX:
                    ghost.popitem(last=False)
                return

    @override
    def candidates(self) -> Iterator[Hashable]:
        first, second = (self._t1, self._t2) if len(self._t1) > self.p else (self._t2, self._t1)
        return iter(list(first) + list(second))
