"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from typing_extensions import override

from tierstore.control.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    @override
    def insert(self, chunk: Hashable) -> None:
        self._order[chunk] = None
        self._order.move_to_end(chunk)

    @override
    def touch(self, chunk: Hashable) -> None:
        if chunk in self._order:
            self._order.move_to_end(chunk)

    @override
    def remove(self, chunk: Hashable) -> None:
        self._order.pop(chunk, None)

    @override
    def candidates(self) -> Iterator[Hashable]:
        # A snapshot, so the caller may remove chunks while iterating.
        return iter(list(self._order))
