"""The eviction policy contract: it orders chunks, the index decides what may go."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator


class EvictionPolicy(ABC):
    """Keeps an eviction order over chunk ids.

    Called by the index under its own (single-threaded) control; never blocks. The index
    filters the candidates (pinned, leased, on another node), so a policy only ranks.
    """

    @abstractmethod
    def insert(self, chunk: Hashable) -> None:
        """A chunk became resident."""

    @abstractmethod
    def touch(self, chunk: Hashable) -> None:
        """A chunk was hit."""

    @abstractmethod
    def remove(self, chunk: Hashable) -> None:
        """A chunk left (evicted or dropped); unknown chunks are ignored."""

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]:
        """Chunks in the order they should be evicted, first victim first."""
