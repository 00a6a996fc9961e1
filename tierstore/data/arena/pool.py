"""A worker's pool of extents its NodeStore granted ahead of time, by size.

A store takes its extents from here at submit, with no round trip. Its commit's answer
brings as many fresh extents as it handed over (:meth:`replenish`), so a steady stream
of stores makes no grant call of its own; the pool asks for more in the background only
when it could not serve another job like the last (:meth:`short`; :meth:`wanted`,
answered by :meth:`add`). How many to keep of a size adapts to the jobs seen: twice the
most taken between two answers (a serving engine submits a burst of stores per step,
one per request), within a byte budget, so a worker holds little of the arena while
idle and enough to never wait while busy. A take that the pool cannot serve whole takes
nothing: the caller falls back or skips the store and counts it.

Thread-safe: ``take`` runs on the model-runner thread, ``add``/``wanted`` on a
transfer thread; one lock, held for microseconds.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Sequence


class ExtentPool:
    def __init__(self, budget_bytes: int, epoch: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.epoch = epoch  # the arena these offsets belong to
        # size -> offsets, in grant order: a fresh arena grants ascending, back-to-back
        # extents, and a job that takes them in that order copies its chunks as one run
        # (:func:`tierstore.data.extent_copy.runs_of`): measured 7x cheaper than 34
        # separate chunks of a 1 MiB job.
        self._free: dict[int, deque[int]] = {}
        self._asked: Counter[int] = Counter()  # size -> extents asked for, not yet added
        self._target: Counter[int] = Counter()
        self._burst: Counter[int] = Counter()  # size -> extents wanted since the last add
        self._lock = threading.Lock()
        self.misses = 0  # takes the pool could not serve whole

    def expect(self, sizes: Sequence[int]) -> None:
        """Jobs like this one are coming: keep extents for two of them."""
        with self._lock:
            self._expect(Counter(sizes))

    def _expect(self, need: Counter[int]) -> None:
        for size, n in need.items():
            self._target[size] = max(self._target[size], 2 * n)

    def take(self, sizes: Sequence[int]) -> list[int] | None:
        """One extent per size (in order), or None and nothing taken."""
        need = Counter(sizes)
        with self._lock:
            self._burst.update(need)  # a missed take counts: the next refill grows
            self._expect(self._burst)
            if self._lacks(need):
                self.misses += 1
                return None
            return [self._free[size].popleft() for size in sizes]

    def short(self, sizes: Sequence[int]) -> bool:
        """Whether another job of these shard sizes would find the pool short."""
        need = Counter(sizes)
        with self._lock:
            return self._lacks(need)

    def _lacks(self, need: Counter[int]) -> bool:
        """Lock held: whether fewer extents than ``need`` of some size are free."""
        return any(len(self._free.get(size, ())) < n for size, n in need.items())

    def _held(self) -> int:
        """Lock held: bytes of the free extents."""
        return sum(s * len(v) for s, v in self._free.items())

    def wanted(self) -> list[int]:
        """Sizes to ask the NodeStore for now (marked asked until :meth:`add`)."""
        with self._lock:
            held = self._held() + sum(s * n for s, n in self._asked.items())
            out: list[int] = []
            for size, target in sorted(self._target.items()):
                have = len(self._free.get(size, ())) + self._asked[size]
                for _ in range(max(0, target - have)):
                    if held + size > self.budget_bytes:
                        break
                    out.append(size)
                    held += size
            self._asked.update(out)
            return out

    def add(self, sizes: Sequence[int], offsets: Sequence[int | None], epoch: str) -> list[int]:
        """The NodeStore's answer to :meth:`wanted`. Returns offsets to give back (granted
        in an arena this pool no longer uses)."""
        with self._lock:
            self._burst.clear()
            for size in sizes:
                self._asked[size] -= 1
            self._asked = +self._asked  # drop non-positive counts
            if epoch != self.epoch:
                return [o for o in offsets if o is not None]
            for size, offset in zip(sizes, offsets, strict=True):
                if offset is not None:
                    self._free.setdefault(size, deque()).append(offset)
            return []

    def replenish(
        self, sizes: Sequence[int], offsets: Sequence[int | None], epoch: str
    ) -> list[int]:
        """Fresh extents a commit's answer brought, one per extent it handed over (not
        asked for by :meth:`wanted`). Returns offsets to give back: of another arena, or
        beyond what the pool keeps (an answer to :meth:`wanted` came meanwhile)."""
        with self._lock:
            self._burst.clear()
            if epoch != self.epoch:
                return [o for o in offsets if o is not None]
            held = self._held()
            extra: list[int] = []
            for size, offset in zip(sizes, offsets, strict=True):
                if offset is None:
                    continue
                free = self._free.setdefault(size, deque())
                if len(free) >= self._target[size] or held + size > self.budget_bytes:
                    extra.append(offset)
                    continue
                free.append(offset)
                held += size
            return extra

    def reset(self, epoch: str) -> list[int]:
        """A new arena (the NodeStore restarted): forget the old one's extents."""
        with self._lock:
            old = [o for offsets in self._free.values() for o in offsets]
            self._free.clear()
            self.epoch = epoch
            return old

    def drain(self) -> list[int]:
        """Every extent held (to give back at shutdown)."""
        return self.reset(self.epoch)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held()
