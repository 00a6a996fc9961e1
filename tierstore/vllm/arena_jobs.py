"""Stores and same-node loads through the node's arena: one copy each way.

A store gathers its pages straight into extents the worker was granted ahead of time (at
submit, on the model-runner thread, no round trip), and is done once its bytes are
there: its blocks may be reused. The commit thread then hashes the extents (off the
model-runner thread, beside the next forward) and sends (key, extent, digest) to the
NodeStore, batched with others (:mod:`tierstore.store.batch_queue`), answered later;
the NodeStore adopts the extents as they are, no copy, no second hash. A same-node load
(of shards any worker of the node stored) finds their extents in the arena's directory
(:mod:`tierstore.data.arena.directory`) and reads them with no round trip: generation,
digest and copy (one pass on the host: :mod:`tierstore.data.fused_copy`), generation
again (:mod:`tierstore.data.arena.generations`); if one is not there, or that check
fails, it pins the extents, verifies each digest in the mapping as it scatters straight
from it, then unpins (one-way, from another thread). Nothing reports a load done before
every digest matched.

Whenever this path cannot serve a job (no arena yet or at all, an empty pool, shards
on another node or not in memory, a copier that cannot copy in place), the caller
takes the object-store path: nothing waits for a grant. A digest mismatch in the
arena also falls back, so the NodeStore's own check reports the corrupt shard.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from tierstore.data.arena.directory import Located
from tierstore.data.arena.generations import UNPINNED_READS
from tierstore.data.checksum import digest
from tierstore.data.layout import JobPlan
from tierstore.errors import (
    ClusterUnavailableError,
    RemoteCallError,
    RemoteCallTimeout,
    TierStoreError,
)
from tierstore.keys import NodeId, ShardId
from tierstore.vllm.device_copy import DeviceCopier, Gathered, Scatter
from tierstore.vllm.transfer_specs import LoadSpec, StoreSpec
from tierstore.vllm.worker_arena import WorkerArena
from tierstore.wire import RefusedCommit, ShardEntry, ShardMeta

logger = logging.getLogger(__name__)

_RETRY_MAP_S = 1.0  # after the NodeStore did not answer an arena_info call


class Filled(NamedTuple):
    """The arena a store gathered into and its extents. ``array`` is the mapping as it
    was at the gather: it keeps the bytes readable after the worker drops a replaced
    arena (closing it empties ``arena.array``), so a stale commit can still be sent."""

    arena: WorkerArena
    offsets: list[int]
    array: np.ndarray


@dataclass(frozen=True, eq=False)
class Commit:
    """A store job gathered into extents, its commit waiting to be sent in a batch;
    ``done`` is set once the NodeStore answered (or the commit failed): what
    ``wait_committed`` waits for. The job itself is reported done before, once its
    bytes are in the extents, with their copy's result."""

    job_id: int
    filled: Filled
    spec: StoreSpec
    plan: JobPlan
    gathered: Gathered
    done: Future[None] = field(default_factory=Future)


class PendingCommits:
    """A worker's arena stores reported done whose commits were not answered yet.
    Any thread; waits hold no lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._commits: set[Commit] = set()

    def add(self, commit: Commit) -> None:
        with self._lock:
            self._commits.add(commit)

    def end(self, batch: list[Commit]) -> None:
        """The commits were answered (or failed): whoever waits on them goes on."""
        with self._lock:
            self._commits.difference_update(batch)
        for c in batch:
            if not c.done.done():
                c.done.set_result(None)

    def wait(self, timeout_s: float, spec: LoadSpec | None = None) -> bool | None:
        """Wait for every pending commit, or only those of ``spec``'s chunks (a load the
        scheduler answered from this engine's own stores: the arena's directory names
        them once committed). True if all ended in time, False at the deadline, None if
        none was pending."""
        keys = set(spec.keys) if spec is not None else set()
        with self._lock:
            pending = [
                c.done
                for c in self._commits
                if spec is None
                or (c.spec.namespace == spec.namespace and not keys.isdisjoint(c.spec.keys))
            ]
        if not pending:
            return None
        _, not_done = futures_wait(pending, timeout=timeout_s)
        return not not_done


class ArenaJobs:
    """One worker's arena path: ``rank`` of ``world_size``; ``connect`` maps the arena
    (a transfer-pool call)."""

    def __init__(
        self,
        copier: DeviceCopier,
        local_node: NodeId,
        rank: int,
        world_size: int,
        connect: Callable[[], WorkerArena | None],
    ) -> None:
        self._copier = copier
        self._local_node = local_node
        self._rank = rank
        self._world_size = world_size
        self._connect = connect
        self._arena: WorkerArena | None = None
        self._connecting = threading.Lock()
        self._no_arena_here = False  # none on the node, or unusable from here: never ask again
        self._retry_at = 0.0  # after a failed try, when to try again
        self._first_sizes: list[int] = []  # of the job that asked for the arena first
        self.arena_stores = 0  # store jobs gathered into the arena
        self.pool_misses = 0  # store jobs that found no granted extents (object store)
        self.arena_loads = 0
        self.arena_rejected = 0  # same-node loads whose extents did not fit or verify
        self.pin_errors = 0  # pins that failed unexpectedly (a bug, logged with its traceback)
        # Same-node loads read extents the arena's directory names without pinning them
        # (x86-64); False: every one pins first (benchmarks compare the two).
        self.read_unpinned = UNPINNED_READS
        self.unpinned_loads = 0  # same-node loads served with no pin

    # ---- set-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Worker start-up, never blocks: map the node's arena (and, on CUDA, register
        it for DMA) on the arena set-up thread now, not at the first job."""
        self._ready()

    def _ready(self, sizes: list[int] | None = None) -> WorkerArena | None:
        """Any thread: the arena if mapped; else start mapping it (once, in the
        background), its pool filled for jobs of ``sizes``."""
        arena = self._arena
        if arena is not None and arena.check_replaced():
            self._drop(arena)
            arena = None
        if arena is None and not self._no_arena_here and self._copier.in_place:
            if sizes and not self._first_sizes:  # the mapping (maybe under way) expects them
                self._first_sizes = sizes
                late = self._arena  # mapped meanwhile, after it read them: expect them here
                if late is not None:
                    late.expect(sizes)
            if time.monotonic() >= self._retry_at and self._connecting.acquire(blocking=False):
                threading.Thread(target=self._map, name="tierstore-arena", daemon=True).start()
        return arena

    def _map(self) -> None:
        try:
            arena = self._connect()
            if arena is not None and not self._copier.attach_arena(arena.array):
                arena.close()  # not registrable for DMA (CUDA): the object store it is
                arena = None
            self._no_arena_here = arena is None
            self._arena = arena
            if arena is not None and self._first_sizes:  # a job came while it was mapped
                arena.expect(self._first_sizes)
        except Exception:  # the NodeStore did not answer (restarting?): try again later
            logger.warning("mapping the node's arena failed", exc_info=True)
            self._retry_at = time.monotonic() + _RETRY_MAP_S
        finally:
            self._connecting.release()

    def _drop(self, arena: WorkerArena) -> None:
        """The NodeStore restarted (a new arena): map the new one next time."""
        if self._arena is arena:
            self._arena = None
            threading.Thread(
                target=self._release, args=(arena,), name="tierstore-arena-close", daemon=True
            ).start()

    def _release(self, arena: WorkerArena) -> None:
        try:
            self._copier.detach_arena(arena.array)  # waits for copies still using it
        except Exception:
            logger.warning("unregistering the arena failed", exc_info=True)
        arena.close()

    # ---- stores ----------------------------------------------------------------------------
    def gather(self, plan: JobPlan, block_ids: np.ndarray) -> tuple[Filled, Gathered] | None:
        """Model-runner thread: the job gathered into granted extents, or None."""
        sizes = [c.nbytes for c in plan.chunks]
        arena = self._ready(sizes)
        if arena is None:
            return None
        offsets = arena.take(sizes)
        try:
            if offsets is None:
                self.pool_misses += 1
                return None
            try:
                gathered = self._copier.gather_into(plan, block_ids, arena.array, offsets)
            except BaseException:
                arena.give_back(offsets)
                raise
        finally:
            arena.refill_if_short(sizes)
        self.arena_stores += 1
        return Filled(arena, offsets, arena.array), gathered

    def commit(self, batch: list[Commit]) -> tuple[list[Commit], list[tuple[Commit, Exception]]]:
        """Commit thread: hand filled extents to the NodeStore with their digests (hashed
        here, off the model-runner thread), one call per arena and namespace, each job's
        entries apart (the NodeStore refuses a job whole, see
        :func:`tierstore.wire.check_job`). Returns the commits its new arena did not
        adopt (it restarted: send :meth:`job_bytes` instead) and those that failed: the
        call, or the NodeStore refused the job (extents given back)."""
        stale: list[Commit] = []
        failed: list[tuple[Commit, Exception]] = []
        groups: dict[tuple[int, str], list[Commit]] = {}
        for c in batch:
            groups.setdefault((id(c.filled.arena), c.spec.namespace), []).append(c)
        for group in groups.values():
            arena = group[0].filled.arena
            jobs = [self._entries(c) for c in group]
            namespace = group[0].spec.namespace
            try:
                answer = arena.commit(namespace, self._rank, self._world_size, jobs)
            except Exception as exc:
                failed += [(c, exc) for c in group]
                continue
            if answer is None:
                stale += group
                continue
            # A job the NodeStore refused (a malformed entry): a failed store, never
            # a stored one; its extents went back to the arena.
            failed += [(group[i], RefusedCommit(why)) for i, why in answer[1].items()]
        return stale, failed

    @staticmethod
    def _entries(commit: Commit) -> list[ShardEntry]:
        (_, offsets, view), spec, plan = commit.filled, commit.spec, commit.plan
        parents = spec.parents or (None,) * len(spec.keys)
        digests = commit.gathered.digests  # hashed as they were copied, or now
        if digests is None:
            pairs = zip(plan.chunks, offsets, strict=True)
            digests = [digest(view[at : at + c.nbytes]) for c, at in pairs]
        return [
            ShardEntry(key, at, c.nbytes, d, c.slot_mask, parent, spec.root)
            for key, c, at, d, parent in zip(
                spec.keys, plan.chunks, offsets, digests, parents, strict=True
            )
        ]

    @staticmethod
    def job_bytes(filled: Filled, plan: JobPlan) -> np.ndarray:
        """The job's bytes as one buffer, copied out of its extents (in job order): for
        the object store, when the arena they were gathered into is gone."""
        pairs = zip(filled.offsets, plan.chunks, strict=True)
        views = [filled.array[at : at + c.nbytes] for at, c in pairs]
        return np.concatenate(views) if views else np.empty(0, dtype=np.uint8)

    # ---- loads -----------------------------------------------------------------------------
    def _mapped(self, scatter: Scatter) -> WorkerArena | None:
        """The arena, if mapped and the copier scatters from it in place."""
        arena = self._ready()
        return arena if arena is not None and scatter.in_place else None

    def _local_arena(self, spec: LoadSpec, scatter: Scatter) -> WorkerArena | None:
        """The arena, if it can pin this load's shards: mapped, and every shard named on
        this node (a pin is a call to this node's NodeStore)."""
        arena = self._mapped(scatter)
        if arena is None or set(spec.keys_by_node(self._rank)) != {self._local_node}:
            return None
        return arena

    def load_unpinned(self, spec: LoadSpec, plan: JobPlan, scatter: Scatter) -> bool:
        """Any thread, no round trip: serve the load from where this node's arena
        directory says its shards are (see :meth:`_read_unpinned`), wherever the spec
        names them: a copy here beats a remote one (a replica made since the HIT, or one
        the scheduler's cluster view did not show yet). False if one is not here or the check
        failed (the caller pins, or loads from the node the spec names)."""
        arena = self._mapped(scatter)
        return arena is not None and self._load_unpinned(arena, spec, plan, scatter)

    def _load_unpinned(
        self, arena: WorkerArena, spec: LoadSpec, plan: JobPlan, scatter: Scatter
    ) -> bool:
        if not self.read_unpinned:
            return False
        keys = list(spec.keys)
        found = arena.directory.find([ShardId(spec.namespace, k, self._rank) for k in keys])
        if found is None or not self._read_unpinned(arena, plan, found, scatter):
            return False
        arena.loaded_unpinned(len(keys), plan.nbytes)
        self.unpinned_loads += 1
        self.arena_loads += 1
        return True

    def load(self, spec: LoadSpec, plan: JobPlan, scatter: Scatter, unpinned: bool = True) -> bool:
        """Transfer thread: serve the load from the local arena, unpinned if it can
        (``unpinned=False``: that was tried already), else pinned; False if this path
        cannot (the caller then loads through the object store)."""
        if unpinned and self.load_unpinned(spec, plan, scatter):
            return True
        arena = self._local_arena(spec, scatter)
        if arena is None:
            return False
        pins = self._pin(arena, spec)
        if pins is None:
            return False
        try:
            if not self._verified_scatter(arena.array, plan, pins, scatter):
                self.arena_rejected += 1
                return False  # the NodeStore's load checks again, and reports it
        finally:
            arena.unpin([at for at, _ in pins])
        self.arena_loads += 1
        return True

    def _pin(self, arena: WorkerArena, spec: LoadSpec) -> list[tuple[int, ShardMeta]] | None:
        """Transfer thread: the load's shards pinned in the arena, or None: the caller
        loads through the object store. Expected refusals fall back: the NodeStore not
        answering (WARNING), a shard not in memory or an arena it replaced (INFO).
        Anything else is a bug, here or in the NodeStore: logged at WARNING with its
        traceback and counted in ``pin_errors``, and the object store serves the load."""
        try:
            return arena.pin(spec.namespace, self._rank, list(spec.keys))
        except (ClusterUnavailableError, RemoteCallTimeout) as exc:
            logger.warning("arena pin unanswered (%s); loading through the object store", exc)
        except RemoteCallError as exc:  # the NodeStore raised what it never raises on purpose
            self._pin_failed(exc)
        except TierStoreError as exc:  # ChunkNotFoundError, StaleArenaError
            logger.info("arena pin refused (%s); loading through the object store", exc)
        except Exception as exc:
            self._pin_failed(exc)
        return None

    def _pin_failed(self, exc: Exception) -> None:
        self.pin_errors += 1
        logger.warning(
            "arena pin failed unexpectedly; loading through the object store", exc_info=exc
        )

    @classmethod
    def _read_unpinned(
        cls, arena: WorkerArena, plan: JobPlan, found: list[Located], scatter: Scatter
    ) -> bool:
        """Scatter the shards straight from where the directory ``found`` them, without a
        pin: True only if each extent's generation was the recorded one before the hash
        and still is after the copy, and its digest matched (see
        :mod:`tierstore.data.arena.generations`). On False the caller pins and scatters
        again (the blocks may hold bytes of this try; nothing reported them done)."""
        offsets = [at for at, _, _ in found]
        generations = [g for _, _, g in found]
        if arena.generations.read(offsets) != generations:
            return False
        shards = [(at, meta) for at, meta, _ in found]
        if not cls._verified_scatter(arena.array, plan, shards, scatter):
            return False
        return arena.generations.read(offsets) == generations

    @staticmethod
    def _verified_scatter(
        view: np.ndarray, plan: JobPlan, shards: list[tuple[int, ShardMeta]], scatter: Scatter
    ) -> bool:
        """Check the shards' extents ``(offset, meta)`` (size, slots, digest) and copy
        them into the load's blocks; False if one does not fit the plan (nothing copied)
        or fails its digest (its blocks may hold some of its bytes: never reported
        loaded)."""
        for chunk, (_, meta) in zip(plan.chunks, shards, strict=True):
            if meta.nbytes != chunk.nbytes or chunk.slot_mask & ~meta.slot_mask:
                return False
        return scatter.from_verified_extents(
            view, plan.chunks, [(at, meta.digest) for at, meta in shards]
        )

    def close(self) -> None:
        arena, self._arena = self._arena, None
        if arena is not None:
            self._release(arena)
