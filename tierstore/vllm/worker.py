"""Worker side (one per rank): moves this rank's shard of each job to and from NodeStores.

Runtime rules (vLLM's model-runner thread calls every method):
- ``submit_*`` never wait on Ray. A store's pages are gathered at submit (on CUDA: a
  copy queued after the compute stream), so the source blocks are free once that copy
  ends; putting the bytes and the NodeStore's acknowledgement happen on other threads.
- a store is gathered straight into extents of the node's shared arena when the
  worker's pool of granted extents has them, and a same-node load scatters straight
  from its extents, unpinned where the arena's directory names them (a small one right
  at submit, on the host executor), else pinned (:mod:`tierstore.vllm.arena_jobs`);
  otherwise (no arena, an empty pool, another node, an arena CUDA would not register)
  through the object store (:mod:`tierstore.vllm.object_loads`).
- every store goes through one *store stream* thread, in submission order (so the
  Evictor's LRU/ARC ranks this worker's chunks by when they were stored, whichever
  path each took). A store gathered into arena extents is reported finished once its
  bytes are there (copied; the stream hashes them after): its source blocks may be
  reused, and the extents stay this worker's until its commit, sent in a batch from
  the stream, is answered (:meth:`TierStoreWorker.wait_committed`); the scheduler's
  manager asks again for a key it saw stored until the Evictor indexes it. An
  object-store store is reported finished once the NodeStore holds it (its job buffer
  is reused after). A load only once its bytes were verified (length, slot coverage,
  xxh3) and are in the destination blocks.
- a load whose holder fails (its NodeStore died, its node is lost) is retried once from
  another copy the Evictor knows of (a hot chunk's copy, or the holder that adopted it).
- a load that still fails (no other copy; a checksum mismatch) is reported as
  ``TransferResult(job_id, success=False)``, never as done: :class:`TierStoreConnector`
  (``tierstore.connector``) turns it into a recompute of its request; vLLM's plain
  ``OffloadingConnector`` asserts success, so there the engine stops loudly instead of
  computing on wrong KV.
- a store that fails costs a future recompute only: it is reported done and counted;
  so is one whose copy raised at submit (``failed_store_launches``): the engine goes on.
- a load never waits behind a store: loads have their own transfer threads, and an
  arena store's copy is waited out by a thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import groupby
from typing import cast

import numpy as np
from typing_extensions import override
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tierstore.data.checksum import digest
from tierstore.data.layout import ChunkLayout, JobPlan
from tierstore.errors import TierStoreError
from tierstore.keys import ShardId
from tierstore.store.batch_queue import BatchQueue
from tierstore.vllm.arena_jobs import ArenaJobs, Commit, PendingCommits
from tierstore.vllm.cpu_affinity import leave_compute_cores
from tierstore.vllm.device_copy import DeviceCopier, Gathered, Scatter, make_copier
from tierstore.vllm.object_loads import ObjectLoads
from tierstore.vllm.transfer_specs import LoadSpec, StoreSpec
from tierstore.vllm.worker_arena import WorkerArena
from tierstore.vllm.worker_ports import NodeStoreCalls, WorkerPorts
from tierstore.wire import PullState, ShardEntry

logger = logging.getLogger(__name__)

__all__ = ["NodeStoreCalls", "TierStoreWorker", "WorkerPorts"]

# Same-node loads up to this size, when the host executor copies them, run at submit on
# the model-runner thread (an unpinned read): a hand-off to a transfer thread costs
# more than a small load's copy; above it the copy dominates, and a long one
# would hold up the step.
INLINE_LOAD_MAX_BYTES = 8 << 20
# Of what is left of a load's deadline, the share its join of a pull may wait (the rest
# covers the call and the copy after it).
_JOIN_SHARE = 0.9


@dataclass(frozen=True, eq=False)
class ObjectPut:
    """A store job that found no granted arena extents: its bytes go to the NodeStore
    through the object store, from the store stream; ``done`` is its job's result."""

    job_id: int
    spec: StoreSpec
    plan: JobPlan
    gathered: Gathered
    done: Future[TransferResult] = field(default_factory=Future)


class TierStoreWorker(OffloadingWorker):
    def __init__(
        self,
        layout: ChunkLayout,
        rank: int,
        world_size: int,
        ports: WorkerPorts,
        transfer_timeout_s: float,
        copier: DeviceCopier | None = None,
    ) -> None:
        """Start-up (vLLM's ``get_worker``): ``copier`` is
        ``make_copier(layout, cfg.pinned_bounce_bytes)`` (on CUDA it reserves the pinned
        bounce pool; the config's default size if None). Starts mapping (and, on CUDA,
        registering) the node's arena on a thread of its own, so that the first jobs
        already find it."""
        self._layout = layout
        self._copier = copier or make_copier(layout)
        self._rank = rank
        self._world_size = world_size
        self._ports = ports
        self._timeout_s = transfer_timeout_s
        # Loads only: a load never queues behind a store. Ray calls release the GIL.
        self._pool = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="tierstore-load", initializer=leave_compute_cores
        )
        # Arena stores whose device copy is still running: one thread waits for each in
        # turn (they end in order on the one store stream) and queues its commit.
        self._copy_waits = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="tierstore-store-copy",
            initializer=leave_compute_cores,
        )
        self._jobs: dict[int, Future[TransferResult]] = {}
        # Store job -> its copy out of the KV blocks: all that wait() needs (the blocks
        # are free to reuse once it is done; the put and the ack may come later).
        self._gathers: dict[int, Gathered] = {}
        self._lock = threading.Lock()
        self.failed_stores = 0  # store jobs lost to a NodeStore or Evictor failure
        self.failed_loads = 0  # load jobs reported failed (their requests recompute)
        self.failed_store_launches = 0  # store jobs whose copy could not be started
        # Loads that named another node: their bytes, those already here at the start
        # (this node's lookup-time pull had landed), loads that joined a pull, and those
        # whose pull failed (reported failed: their requests recompute).
        self.remote_named_bytes = 0
        self.remote_named_bytes_local = 0
        self.joined_pulls = 0
        self.failed_pulls = 0
        self._stores = BatchQueue(
            self._send_stores, "tierstore-stores", on_start=leave_compute_cores
        )
        self._uncommitted = PendingCommits()  # reported done, not answered yet
        self._objects = ObjectLoads(ports, rank, transfer_timeout_s)
        self.arena = ArenaJobs(self._copier, ports.local_node, rank, world_size, self._map_arena)
        self.arena.start()

    def _map_arena(self) -> WorkerArena | None:
        """Arena set-up thread: map the node's arena; a NodeStore that did not answer is
        looked up again next time (it may have been restarted)."""
        local = self._ports.local_node
        try:
            return WorkerArena.connect(lambda: self._ports.node_store(local), self._timeout_s)
        except Exception:
            self._ports.forget_node_store(local)
            raise

    # ---- stores ----------------------------------------------------------------------------
    @override
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, StoreSpec), type(dst_spec)
        plan = self._plan(src_spec, len(dst_spec.keys), job_id)  # a mismatch is a bug: raised
        try:
            # Straight into granted arena extents if the pool has them, else a job buffer.
            filled = self.arena.gather(plan, src_spec.block_ids)
            extents, gathered = filled or (None, self._copier.gather(plan, src_spec.block_ids))
        except Exception as exc:  # the copy could not even start: a lost store, not a crash
            self.failed_store_launches += 1
            self._store_failed(job_id, len(dst_spec.keys), exc, forget_store=False)
            self._track(job_id, _done(TransferResult(job_id, True, 0, 0.0)))
            return True
        with self._lock:
            self._gathers[job_id] = gathered
        if extents is None:  # put from the store stream, in submission order
            put = ObjectPut(job_id, dst_spec, plan, gathered)
            self._track(job_id, put.done)
            self._queue_store(put)
            return True
        commit = Commit(job_id, extents, dst_spec, plan, gathered)
        self._uncommitted.add(commit)
        if gathered.copied():  # host copies: already in the extents
            self._track(job_id, _done(_copied(commit)))
            self._queue_store(commit)
        else:  # a device copy still running: queue it from a transfer thread once done
            self._track(job_id, self._copy_waits.submit(self._commit_when_copied, commit))
        return True

    def _commit_when_copied(self, commit: Commit) -> TransferResult:
        """Transfer thread: wait for the device copy, then queue the commit; a copy that
        failed loses the store (counted), and its job still ends done."""
        try:
            commit.gathered.wait_copied()
        except Exception as exc:
            self._store_failed(commit.job_id, len(commit.plan.chunks), exc)
            self._uncommitted.end([commit])
            return _copied(commit)
        self._queue_store(commit)
        return _copied(commit)

    def wait_committed(self, timeout_s: float) -> bool:
        """Blocks until every arena store submitted so far was committed (answered by its
        NodeStore, or failed and counted); False at the deadline. For tests and
        benchmarks: vLLM never needs it."""
        return self._uncommitted.wait(timeout_s) is not False

    def _put_object(self, put: ObjectPut) -> None:
        """Store stream: the object-store path (no arena extents at hand); the job is
        done once the NodeStore holds its bytes (its job buffer is reused after), or
        once the store failed (counted)."""
        try:
            self._put(put.spec, put.plan, put.gathered())
        except Exception as exc:
            self._store_failed(put.job_id, len(put.plan.chunks), exc)
        finally:
            put.done.set_result(_copied(put))

    def _queue_store(self, item: Commit | ObjectPut) -> None:
        """Any thread; never blocks. Every queued job ends done, sent or not."""
        try:
            self._stores.put(item)
        except Exception as exc:  # shut down
            self._store_failed(item.job_id, len(item.plan.chunks), exc)
            if isinstance(item, Commit):
                self._uncommitted.end([item])
            else:
                item.done.set_result(_copied(item))

    def _send_stores(self, batch: list[Commit | ObjectPut]) -> None:
        """Store stream thread: the queued stores in the order they were submitted, so
        the Evictor ranks (LRU, ARC) this worker's chunks by when they were stored, even
        when the arena pool ran dry and some went through the object store. A run of
        arena commits goes in one call; each object put in its own."""
        for is_commit, run in groupby(batch, key=lambda item: isinstance(item, Commit)):
            items = list(run)
            try:  # one failing run must not leave the later ones' jobs unfinished
                if is_commit:
                    self._send_commits(cast(list[Commit], items))
                else:
                    for put in items:
                        self._put_object(cast(ObjectPut, put))
            except Exception:
                logger.error("sending %d queued stores failed", len(items), exc_info=True)

    def _send_commits(self, batch: list[Commit]) -> None:
        """Store stream thread: one call for the queued commits; a NodeStore with a new arena
        (restarted) gets those jobs' bytes through the object store. Each job is
        reported done afterwards, whatever happened (a lost store is counted)."""
        try:
            stale, failed = self.arena.commit(batch)
            for c in stale:
                try:
                    self._put(c.spec, c.plan, self.arena.job_bytes(c.filled, c.plan))
                except Exception as exc:
                    failed.append((c, exc))
            for c, error in failed:
                self._store_failed(c.job_id, len(c.plan.chunks), error)
        finally:
            self._uncommitted.end(batch)

    def _store_failed(
        self, job_id: int, n_chunks: int, error: Exception, forget_store: bool = True
    ) -> None:
        """A lost store costs a future recompute, never wrong output: the job is
        reported done (vLLM has no failure path), counted, and the worker keeps serving.
        ``forget_store``: the NodeStore may be what failed (look it up again)."""
        logger.warning(
            "store job %d failed; its %d chunks are not offloaded", job_id, n_chunks, exc_info=error
        )
        self.failed_stores += 1
        if forget_store:
            self._ports.forget_node_store(self._ports.local_node)
        try:
            self._ports.report_failed_stores(1)
        except TierStoreError:  # best effort: the Evictor may be what failed
            logger.debug("could not report the failed store", exc_info=True)
        except Exception:  # a bug: never hidden
            logger.warning("reporting the failed store to the Evictor raised", exc_info=True)

    def _put(self, spec: StoreSpec, plan: JobPlan, buffer: np.ndarray) -> int:
        parents = spec.parents or (None,) * len(spec.keys)
        entries = [
            ShardEntry(
                key,
                c.offset,
                c.nbytes,
                digest(buffer[c.offset : c.offset + c.nbytes]),
                c.slot_mask,
                parent,
                spec.root,  # which Evictor shard indexes it
            )
            for key, c, parent in zip(spec.keys, plan.chunks, parents, strict=True)
        ]
        kept = (
            self._ports.node_store(self._ports.local_node)
            .store(spec.namespace, self._rank, self._world_size, entries, buffer)
            .result(self._timeout_s)
        )
        logger.debug("%d of %d shards kept", kept, len(entries))
        return kept

    # ---- loads -----------------------------------------------------------------------------
    @override
    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        assert isinstance(src_spec, LoadSpec), type(src_spec)
        plan = self._plan(dst_spec, len(src_spec.keys), job_id)
        # Here, on the model-runner thread: on CUDA the copy is ordered after its stream.
        scatter = self._copier.prepare_scatter(plan, dst_spec.block_ids, expedited)
        started = time.perf_counter()
        inline = scatter.on_caller and plan.nbytes <= INLINE_LOAD_MAX_BYTES
        if inline and self._loaded_inline(src_spec, plan, scatter):
            self._count_remote(src_spec, plan, local_at_start=True)
            result = TransferResult(job_id, True, plan.nbytes, time.perf_counter() - started)
            self._track(job_id, _done(result))
            return True
        self._track(
            job_id,
            self._pool.submit(self._load_or_fail, job_id, src_spec, scatter, plan, started, inline),
        )
        return True

    def _loaded_inline(self, spec: LoadSpec, plan: JobPlan, scatter: Scatter) -> bool:
        """Model-runner thread: a small unpinned same-node load on the host executor
        (:data:`INLINE_LOAD_MAX_BYTES`). True once its bytes are in place; False
        (nothing reported) sends it to a transfer thread."""
        try:
            return self.arena.load_unpinned(spec, plan, scatter)
        except Exception:  # the transfer thread tries again, and reports a failure
            logger.warning("an inline arena load failed; retrying it pinned", exc_info=True)
            return False

    def _load_or_fail(
        self,
        job_id: int,
        spec: LoadSpec,
        scatter: Scatter,
        plan: JobPlan,
        started: float,
        tried_unpinned: bool = False,
    ) -> TransferResult:
        """Transfer thread: a failed load is a result (``success=False``), not an
        exception, so the connector can recompute its request and the engine keeps going."""
        try:
            # Its scheduler answers chunks it just stored as HITs: their commits first.
            waited = self._uncommitted.wait(self._timeout_s, spec) is not None
            if self.arena.load(spec, plan, scatter, unpinned=waited or not tried_unpinned):
                self._count_remote(spec, plan, local_at_start=not tried_unpinned)
                return TransferResult(job_id, True, plan.nbytes, time.perf_counter() - started)
            self._count_remote(spec, plan, local_at_start=False)
            # Shards named on other nodes: this node's lookup-time pulls of them, joined.
            here = self._join_pulls(spec, started)
            if here is None or not self.arena.load(here, plan, scatter):
                self._objects.load(here or spec, plan, scatter)  # else the object store
            return TransferResult(job_id, True, plan.nbytes, time.perf_counter() - started)
        except Exception:
            self.failed_loads += 1
            logger.error(
                "load job %d (%d chunks) failed; its request must recompute them",
                job_id,
                len(spec.keys),
                exc_info=True,
            )
            return TransferResult(job_id, False)

    def _join_pulls(self, spec: LoadSpec, started: float) -> LoadSpec | None:
        """Transfer thread: wait (within the load's deadline) for this node's pulls of
        the shards ``spec`` names on other nodes (started when the lookup answered, or
        now by this call if the load came first: :mod:`tierstore.store.pulls`). Returns
        ``spec`` with those now held here named on this node, or None if none is (its
        pull still queued: the load pulls them itself). Raises if a pull failed or is
        still running at the deadline: the load fails and its request recomputes."""
        local = self._ports.local_node
        remote = [
            (i, node)
            for node, idx in spec.keys_by_node(self._rank).items()
            if node != local
            for i in idx
        ]
        if not remote:
            return None
        left = self._timeout_s - (time.perf_counter() - started)
        if left <= 0:  # no time to join: the load reads from the holders
            return None
        pulls = [(ShardId(spec.namespace, spec.keys[i], self._rank), node) for i, node in remote]
        try:
            store = self._ports.node_store(local)
            states = store.wait_pulls(pulls, left * _JOIN_SHARE).result(left)
        except Exception as exc:  # this node's NodeStore did not answer: pull here
            logger.warning("could not join this node's pulls (%s); loading from the holders", exc)
            self._ports.forget_node_store(local)
            return None
        if PullState.FAILED in states:
            self.failed_pulls += 1
            raise TierStoreError(
                f"this node's pull of {states.count(PullState.FAILED)} of {len(pulls)} shards "
                "failed or outlived the load's deadline"
            )
        held = {i for (i, _), state in zip(remote, states, strict=True) if state is PullState.HELD}
        if not held:
            return None
        self.joined_pulls += 1
        where = [{r: spec.nodes[n] for r, n in enumerate(at)} for at in spec.locations]
        for i in held:
            where[i][self._rank] = local
        return LoadSpec.build(spec.namespace, list(spec.keys), where, spec.root)

    def _count_remote(self, spec: LoadSpec, plan: JobPlan, local_at_start: bool) -> None:
        """Bytes of loads that named another node for this rank, and of those, the bytes
        already in this node's arena when the load started (its first read found them)."""
        local = self._ports.local_node
        nbytes = sum(
            plan.chunks[i].nbytes
            for node, idx in spec.keys_by_node(self._rank).items()
            if node != local
            for i in idx
        )
        with self._lock:
            self.remote_named_bytes += nbytes
            if local_at_start:
                self.remote_named_bytes_local += nbytes

    @property
    def relocated_loads(self) -> int:
        """Load jobs served (in part) by another copy."""
        return self._objects.relocated

    # ---- completion ------------------------------------------------------------------------
    def _plan(self, spec: GPULoadStoreSpec, n_keys: int, job_id: int) -> JobPlan:
        plan = self._layout.plan(spec.group_sizes, spec.block_indices)
        if len(plan.chunks) != n_keys:
            raise TierStoreError(
                f"job {job_id}: {n_keys} keys for {len(plan.chunks)} chunks of blocks "
                f"(group_sizes={list(spec.group_sizes)}, block_indices={list(spec.block_indices)})"
            )
        return plan

    def _track(self, job_id: int, future: Future[TransferResult]) -> None:
        with self._lock:
            self._jobs[job_id] = future

    @override
    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done = [job_id for job_id, f in self._jobs.items() if f.done()]
            futures = [self._jobs.pop(job_id) for job_id in done]
            for job_id in done:
                self._gathers.pop(job_id, None)
        results = []
        for job_id, future in zip(done, futures, strict=True):
            exc = future.exception()
            if exc is not None:
                raise TierStoreError(f"tierstore transfer job {job_id} failed: {exc}") from exc
            results.append(future.result())
        return results

    @override
    def wait(self, job_ids: set[int]) -> None:
        """vLLM flushes store jobs whose source blocks it is about to reuse: only their
        copy must be done. Any other job is waited for whole (errors: get_finished)."""
        with self._lock:
            copies = [self._gathers[j] for j in job_ids if j in self._gathers]
            futures = [self._jobs[j] for j in job_ids if j in self._jobs and j not in self._gathers]
        for copy in copies:
            copy.wait_copied()
        for future in futures:
            future.exception()  # blocks

    @override
    def shutdown(self) -> None:
        self._copy_waits.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._stores.close(self._timeout_s)
        self.arena.close()


def _copied(job: Commit | ObjectPut) -> TransferResult:
    """A store job's result once its bytes were copied out of its blocks (into extents,
    or a buffer for the object store): the copy's own time, as vLLM's kv_offload
    bandwidth is the copy's, not Ray's. Success whether or not the store landed: a
    failed one is counted, and its blocks were free to reuse all the same."""
    return TransferResult(job.job_id, True, job.plan.nbytes, job.gathered.copy_seconds)


def _done(result: TransferResult) -> Future[TransferResult]:
    future: Future[TransferResult] = Future()
    future.set_result(result)
    return future
