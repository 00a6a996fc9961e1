"""A worker's side of its node's arena: the mapping, its proof of life, its extent pool.

Stores gather straight into extents the NodeStore granted ahead of time and commit them
in one call; same-node loads pin extents and scatter straight out of the mapping. Set
up lazily on a transfer thread (:meth:`WorkerArena.connect`); until then, and whenever
the arena cannot be used (no arena on the node, a mapping that fails, a pool that is
empty), the worker takes the object-store path, so nothing ever waits for a grant.

Threads: ``take`` runs on the model-runner thread and never blocks; everything else on
transfer threads; pool refills, unpins and give-backs on this class's own thread, which
logs and survives its errors. Extents this worker was granted and will not fill are
owed to the NodeStore until it confirms their return: a give-back that fails is logged
at WARNING, counted (``failed_give_backs``) and sent again with the next grant call and
at :meth:`WorkerArena.close` (a worker that dies owing them leaves them to the
NodeStore, which reclaims a dead holder's grants).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tierstore.data.arena.directory import EMPTY_BYTES, ShardDirectory, arena_tables
from tierstore.data.arena.generations import Generations
from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.pool import ExtentPool
from tierstore.data.arena.region import ArenaMapping
from tierstore.keys import ChunkKey, Namespace
from tierstore.vllm.cpu_affinity import leave_compute_cores
from tierstore.wire import RegionInfo, Reply, ShardEntry, ShardMeta

logger = logging.getLogger(__name__)

# A worker's pool holds at most 1/_POOL_SHARE of the arena's room for grants.
_POOL_SHARE = 2
# How often a worker looks whether its arena's file was replaced (a NodeStore restart).
_FILE_CHECK_S = 1.0


class ArenaCalls(Protocol):
    """The local NodeStore's arena calls (its client implements them)."""

    def arena_info(self) -> Reply[tuple[RegionInfo | None, int]]: ...

    def arena_grant(
        self, holder: str, epoch: str, sizes: list[int]
    ) -> Reply[tuple[str, list[int | None]]]: ...

    def arena_commit(
        self,
        holder: str,
        epoch: str,
        namespace: Namespace,
        rank: int,
        world_size: int,
        jobs: list[list[ShardEntry]],
    ) -> Reply[tuple[int, str, list[int | None], list[tuple[int, str]]]]: ...

    def arena_give_back(self, holder: str, epoch: str, offsets: list[int]) -> Reply[None]: ...

    def arena_pin(
        self, holder: str, epoch: str, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> Reply[list[tuple[int, ShardMeta]]]: ...

    def arena_unpin(self, holder: str, epoch: str, offsets: list[int]) -> Reply[None]: ...

    def arena_loaded(self, epoch: str, shards: int, nbytes: int) -> Reply[None]: ...


@dataclass
class UnreportedLoads:
    """Loads read without a pin since the NodeStore was last told (its load counts)."""

    shards: int = 0
    nbytes: int = 0


class WorkerArena:
    """Built by :meth:`connect`; ``calls`` gives the local NodeStore's current client."""

    def __init__(
        self,
        calls: Callable[[], ArenaCalls],
        info: RegionInfo,
        grant_room: int,
        timeout_s: float,
    ) -> None:
        self._calls = calls
        self._timeout_s = timeout_s
        self.info = info
        self.mapping = ArenaMapping(info)
        self.generations, self.directory = arena_tables(self.mapping.array)
        self._unreported = UnreportedLoads()
        self._unreported_lock = threading.Lock()
        self._owed: dict[str, list[int]] = {}  # epoch -> extents given back, not confirmed
        self._owed_lock = threading.Lock()
        self.failed_give_backs = 0  # give-back calls that failed (their extents retried)
        self._lock_file = HolderLock(info.path)
        self.holder = self._lock_file.holder
        self.pool = ExtentPool(max(grant_room // _POOL_SHARE, 0), info.epoch)
        self._refiller = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tierstore-grant", initializer=leave_compute_cores
        )
        self._refilling = threading.Lock()  # held while a refill is queued or running
        self.stale = False  # the NodeStore has a new arena: this mapping is of the old one
        self._next_file_check = time.monotonic() + _FILE_CHECK_S

    @classmethod
    def connect(cls, calls: Callable[[], ArenaCalls], timeout_s: float) -> WorkerArena | None:
        """The node's arena, mapped; None if the NodeStore has none or it cannot be
        mapped from here (another container's /dev/shm): then the object store it is.
        Raises if the NodeStore did not answer (it may be restarting: ask again later)."""
        info, grant_room = calls().arena_info().result(timeout_s)
        if info is None:
            return None
        try:
            return cls(calls, info, grant_room, timeout_s)
        except Exception:
            logger.warning("the node's arena cannot be used; using the object store", exc_info=True)
            return None

    @property
    def epoch(self) -> str:
        return self.pool.epoch

    def check_replaced(self) -> bool:
        """Any thread, a ``stat`` at most once a second: whether this arena was replaced
        (a NodeStore restart) or removed, so the worker maps the new one. Loads that
        find their shards in the directory make no call that would tell it otherwise."""
        now = time.monotonic()
        if not self.stale and now >= self._next_file_check:
            self._next_file_check = now + _FILE_CHECK_S
            self.stale = self.mapping.replaced()
        return self.stale

    # ---- stores ----------------------------------------------------------------------------
    def expect(self, sizes: list[int]) -> None:
        """Fill the pool for jobs of these shard sizes (in the background)."""
        self.pool.expect(sizes)
        self.refill()

    def take(self, sizes: list[int]) -> list[int] | None:
        """Model-runner thread: granted extents for a job's shards, or None (take the
        other path). Call :meth:`refill_if_short` after the job's copy."""
        return self.pool.take(sizes)

    def refill_if_short(self, sizes: list[int]) -> None:
        """Any thread, never blocks: refill now if another job of these shard sizes
        would find the pool short; else the job's commit brings its extents' successors."""
        if self.pool.short(sizes):
            self.refill()

    def commit(
        self, namespace: Namespace, rank: int, world_size: int, jobs: list[list[ShardEntry]]
    ) -> tuple[int, dict[int, str]] | None:
        """Transfer thread: hand filled extents, the entries of each store job, to the
        NodeStore; returns (shards kept, the jobs it refused: index -> why), or None if
        it has a new arena (restarted) and adopted nothing. A refused job's extents, and
        on failure every one, are given back (those it adopted are no longer granted, so
        giving them back frees nothing of theirs). The answer's fresh extents go to the
        pool."""
        epoch = self.epoch
        entries = [e for job in jobs for e in job]
        try:
            kept, current, granted, refused = (
                self._calls()
                .arena_commit(self.holder, epoch, namespace, rank, world_size, jobs)
                .result(self._timeout_s)
            )
        except Exception:
            self.give_back([e.offset for e in entries], epoch)
            raise
        if current != epoch:
            self.stale = True  # nothing was adopted: those extents are not that arena's
            return None
        why = {int(i): str(reason) for i, reason in refused}
        self.give_back([e.offset for i, job in enumerate(jobs) if i in why for e in job], epoch)
        extra = self.pool.replenish([e.nbytes for e in entries], granted, current)
        self.give_back(extra, current)
        return int(kept), why

    def give_back(self, offsets: list[int], epoch: str | None = None) -> None:
        """Any thread, never waits: granted extents (of arena ``epoch``, default the
        current one) this worker will not fill. Owed until the NodeStore confirms them:
        sent from the refill thread (see :meth:`_return_owed`)."""
        if not offsets:
            return
        with self._owed_lock:
            self._owed.setdefault(epoch or self.epoch, []).extend(offsets)
        try:
            self._refiller.submit(self._return_owed)
        except RuntimeError:  # shut down: close() sends what is owed
            pass

    def _return_owed(self) -> None:
        """Refill thread (or :meth:`close`): give back every owed extent, one waited
        call per arena epoch. A call that fails is logged at WARNING and counted, and its
        extents stay owed: sent again with the next grant call, or at close."""
        with self._owed_lock:
            owed, self._owed = self._owed, {}
        for epoch, offsets in owed.items():
            try:
                reply = self._calls().arena_give_back(self.holder, epoch, offsets)
                reply.result(self._timeout_s)
            except Exception:
                self.failed_give_backs += 1
                logger.warning(
                    "could not give %d granted extents back to the NodeStore; they stay "
                    "granted to this worker until a later give-back reaches it or it exits",
                    len(offsets),
                    exc_info=True,
                )
                with self._owed_lock:
                    self._owed.setdefault(epoch, []).extend(offsets)

    # ---- loads -----------------------------------------------------------------------------
    def pin(
        self, namespace: Namespace, rank: int, keys: list[ChunkKey]
    ) -> list[tuple[int, ShardMeta]]:
        """Transfer thread: the shards' extents and metadata, pinned until :meth:`unpin`
        (waits up to the transfer timeout)."""
        reply = self._calls().arena_pin(self.holder, self.epoch, namespace, rank, keys)
        return reply.result(self._timeout_s)

    def unpin(self, offsets: list[int]) -> None:
        """Any thread, never waits: sent from the refill thread, so a load is reported
        done without paying for the call (one-way; the NodeStore also unpins what a dead
        holder left)."""
        try:
            self._refiller.submit(self._unpin, self.epoch, offsets)
        except RuntimeError:  # shut down
            self._unpin(self.epoch, offsets)

    def _unpin(self, epoch: str, offsets: list[int]) -> None:
        try:
            self._calls().arena_unpin(self.holder, epoch, offsets)
        except Exception:
            logger.warning("could not unpin %d extents", len(offsets), exc_info=True)

    def loaded_unpinned(self, shards: int, nbytes: int) -> None:
        """Any thread, never waits: tell the NodeStore (for its load counts) from the
        refill thread; loads that end meanwhile go in the same one-way call."""
        with self._unreported_lock:
            queued = self._unreported.shards > 0  # a report is queued: these join it
            self._unreported.shards += shards
            self._unreported.nbytes += nbytes
        if queued:
            return
        try:
            self._refiller.submit(self._report_loaded, self.epoch)
        except RuntimeError:  # shut down: the counts are lost, nothing else
            pass

    def _report_loaded(self, epoch: str) -> None:
        """Refill thread: one call for every load that ended since the last one."""
        with self._unreported_lock:
            loads, self._unreported = self._unreported, UnreportedLoads()
        if loads.shards:
            try:  # one-way: only a send that fails is seen
                self._calls().arena_loaded(epoch, loads.shards, loads.nbytes)
            except Exception:
                logger.warning(
                    "could not report %d unpinned loads to the NodeStore (its load counts "
                    "miss them)",
                    loads.shards,
                    exc_info=True,
                )

    @property
    def array(self) -> np.ndarray:
        return self.mapping.array

    # ---- refills ---------------------------------------------------------------------------
    def refill(self) -> None:
        """Any thread, never blocks: queue a refill (it asks only for what the pool
        lacks). A store queues it after its copy, so the grant call does not compete
        with the copy."""
        if self._refilling.acquire(blocking=False):
            try:
                self._refiller.submit(self._refill)
            except RuntimeError:  # shut down
                self._refilling.release()

    def _refill(self) -> None:
        """Refill thread: ask for what the pool wants until it wants no more, the arena
        is full or a call fails; errors are logged."""
        try:
            self._return_owed()  # a give-back that failed goes with the next grant call
            while self._refill_once():
                pass  # jobs took extents while the last grant was in flight
        except Exception:
            logger.error("arena refill failed", exc_info=True)
        finally:
            self._refilling.release()

    def _refill_once(self) -> bool:
        """One grant call for what the pool wants; False when it wants nothing more
        (or the call failed)."""
        sizes = self.pool.wanted()
        if not sizes:
            return False
        try:
            epoch, offsets = (
                self._calls().arena_grant(self.holder, self.epoch, sizes).result(self._timeout_s)
            )
        except Exception:
            self.pool.add(sizes, [None] * len(sizes), self.epoch)
            logger.warning("arena grant failed; stores take the object store", exc_info=True)
            return False
        if epoch != self.epoch:
            self.stale = True  # granted nothing; the worker maps the new arena
        stale = self.pool.add(sizes, offsets, epoch)
        self.give_back(stale, epoch)
        return not stale and None not in offsets  # the arena is not full

    def close(self) -> None:
        """Worker shutdown: give back what the pool holds and what is still owed (waits
        up to the transfer timeout), then release the lock."""
        self._refiller.shutdown(wait=True)
        self.give_back(self.pool.drain())
        self._return_owed()
        self._lock_file.close()
        # The tables are views of the mapping: after it, no shard is found and every
        # generation check fails (one no extent reaches), so no load reads the unmapped
        # arena.
        self.directory = ShardDirectory(np.zeros(EMPTY_BYTES, dtype=np.uint8))
        self.generations = Generations(np.full(8, 255, dtype=np.uint8))
        self.mapping.close()
