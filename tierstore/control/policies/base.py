"""The eviction policy contract: it orders units, the index decides what may go."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Sequence


class EvictionPolicy(ABC):
    """Keeps an eviction order over unit ids.

    Called by the index under its own (single-threaded) control; never blocks. The index
    filters the candidates (pinned, leased, on another node, not a tail), so a policy only
    ranks. The order is split into *segments* (LRU has one, ARC two: ``t1`` and ``t2``)
    whose relative order may change; inside a segment, a unit's rank only grows (each
    touch moves it to the end). That is what lets the index keep its own per-node,
    per-tier candidate heaps keyed by :meth:`position` instead of walking every unit.
    """

    @abstractmethod
    def insert(self, unit: Hashable) -> None:
        """A unit became resident."""

    @abstractmethod
    def touch(self, unit: Hashable) -> None:
        """A unit was hit."""

    @abstractmethod
    def remove(self, unit: Hashable) -> None:
        """A unit left (evicted or dropped); unknown units are ignored."""

    @abstractmethod
    def position(self, unit: Hashable) -> tuple[int, int] | None:
        """``(segment, rank)`` of a tracked unit, ``None`` for an unknown one."""

    @abstractmethod
    def segment_order(self) -> Sequence[int]:
        """The segments in the order their units should be evicted, right now."""

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Every unit, first victim first: O(units), for tests and tools, not eviction."""
