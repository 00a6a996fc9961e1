"""Least recently used."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from itertools import count

from typing_extensions import override

from tierstore.control.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """One segment; a unit's rank is the tick of its last insert or touch."""

    def __init__(self) -> None:
        # A plain dict keeps insertion order and costs less than an OrderedDict per unit.
        self._rank: dict[Hashable, int] = {}
        self._clock = count()

    @override
    def insert(self, unit: Hashable) -> None:
        self._rank.pop(unit, None)
        self._rank[unit] = next(self._clock)

    @override
    def touch(self, unit: Hashable) -> None:
        if unit in self._rank:
            self.insert(unit)

    @override
    def remove(self, unit: Hashable) -> None:
        self._rank.pop(unit, None)

    @override
    def position(self, unit: Hashable) -> tuple[int, int] | None:
        rank = self._rank.get(unit)
        return None if rank is None else (0, rank)

    @override
    def segment_order(self) -> Sequence[int]:
        return (0,)

    @override
    def candidates(self) -> Iterator[Hashable]:
        # A snapshot, so the caller may remove units while iterating.
        return iter(list(self._rank))
