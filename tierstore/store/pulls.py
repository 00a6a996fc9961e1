"""Copies a node pulls at lookup time (issue 30): when a lookup from this node answered
HIT for chunks held only on other nodes, the Evictor reserved a hot-chunk copy of each
here (the replica rules: below the low watermark, evicted first, never written to disk)
and tells this NodeStore which shards to pull from which holder. The pull starts at
once, so the bytes cross the network while the request is still being scheduled; the
engine's load then finds them in this node's arena, or waits for the pull in flight.

- one pull per holder and message (a request's lookup: every rank's shards of its
  chunks that one node holds come in one call and one object), holders in parallel, at
  most ``workers`` at once on this node (``pulls_per_node``);
- a shard already being pulled is not pulled again (two requests asking for the same
  chunk at once: one pull); the Evictor starts no second copy of a chunk either;
- what lands is verified and kept as the Evictor's replica; a pull that fails keeps
  nothing, and its room is given back. The loads waiting on a pull go on as soon as its
  bytes are kept: its one-way reports (to the Evictor which shards landed, to the holder
  that its loan ended) are sent after, off their path;
- :meth:`Pulls.wait` is a load's join, or its start: the worker names each shard's
  holder, and a shard neither held here nor being pulled is pulled now, as the Evictor's
  message would have it (the Evictor's pull message and the worker's load reach the
  NodeStore from two callers in no set order; the message that comes second finds the
  pull in flight, or the shard held, and starts none). It then waits for the shards'
  pulls running now (at most its deadline) and says of each whether it is held here,
  failed, or none is running (still queued behind other holders' pulls: the load pulls
  it from its holder itself, so one slow holder never fails loads from the others). A
  copy a load started is kept as the Evictor's replica like any other: the lookup that
  the same step sent reserved it, or the Evictor has it dropped when it is reported.

No Ray here: ``move`` (the holder's call, the bytes' move to this node and their
keeping, by the actor's transport) is the actor's. Threads: :meth:`start` and
:meth:`wait` on any thread (they hold the lock only to look up and register futures);
pulls on the pool's own threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import NamedTuple

from tierstore.keys import NodeId, ShardId
from tierstore.store.replicas import Landed
from tierstore.wire import PullState

logger = logging.getLogger(__name__)

__all__ = ["Move", "Moved", "PullState", "Pulls"]


class Moved(NamedTuple):
    """What one pull moved: its bytes; the seconds until they were on this node (the
    holder's call and the move; the rest of the pull verified and kept them); which
    shards were kept; and, for a loan (NIXL), its end: a one-way call to the holder."""

    nbytes: int
    fetch_s: float
    landed: Landed
    end_loan: Callable[[], object] | None = None


# (holder, shard ids) -> Moved: fetch the shards from their holder and keep on this node
# what verifies; raises if the move failed (nothing kept; a loan it made, ended).
Move = Callable[[NodeId, list[ShardId]], Moved]


class Pulls:
    """One node's lookup-time pulls."""

    def __init__(
        self,
        move: Move,
        report: Callable[[Landed], None],
        holds: Callable[[ShardId], bool],
        workers: int,
    ) -> None:
        """``move`` fetches, verifies and keeps a pull's shards; ``report`` tells the
        Evictor (one-way) which shards of a pull were kept, and which not (all of them
        when ``move`` raised); ``holds``: whether this node holds a shard now."""
        self._move = move
        self._report = report
        self._holds = holds
        self._workers = max(1, workers)
        self._pool = ThreadPoolExecutor(
            max_workers=self._workers, thread_name_prefix="tierstore-pull"
        )
        self._lock = threading.Lock()
        self._in_flight: dict[ShardId, Future[bool]] = {}
        self._active = 0  # pulls submitted and not ended
        self._running: set[Future[bool]] = set()  # begun, or sure to begin at once
        self._counts = {
            "pulls": 0,
            "started_by_loads": 0,  # of ``pulls``: started by a load that came first
            "shards": 0,
            "bytes": 0,
            "failed": 0,
            "joined": 0,
            "waits": 0,
        }
        # Where the landed pulls' time went, summed: the holder's call with the bytes'
        # move to this node (fetch), then verifying and keeping them here (accept).
        self._times_s = {"fetch": 0.0, "accept": 0.0}

    def start(self, pulls: Sequence[tuple[ShardId, NodeId]]) -> int:
        """Pull each shard from its holder, one pull per holder; a shard already being
        pulled, or held here (a load's pull of it landed first), is skipped. Returns the
        pulls started. Never blocks."""
        return len(set(self._start(pulls).values()))

    def _start(self, pulls: Sequence[tuple[ShardId, NodeId]]) -> dict[ShardId, Future[bool]]:
        """:meth:`start`'s work: the shards it started a pull of, each with its pull."""
        by_holder: dict[NodeId, list[ShardId]] = {}
        futures: dict[NodeId, Future[bool]] = {}
        with self._lock:
            for shard_id, holder in pulls:
                shard_id, holder = ShardId(*shard_id), NodeId(holder)
                if shard_id in self._in_flight or self._holds(shard_id):
                    self._counts["joined"] += 1
                    continue
                if holder not in futures:
                    futures[holder] = Future()
                    if self._active < self._workers:  # a pool thread is free for it
                        self._running.add(futures[holder])
                    self._active += 1
                future = futures[holder]
                self._in_flight[shard_id] = future
                by_holder.setdefault(holder, []).append(shard_id)
            self._counts["pulls"] += len(by_holder)
        for holder, shard_ids in by_holder.items():
            try:
                self._pool.submit(self._pull, holder, shard_ids, futures[holder])
            except RuntimeError:  # shut down
                self._end(shard_ids, futures[holder], False)
                self._send("report", self._report, Landed([], shard_ids))
        return {s: futures[holder] for holder, ids in by_holder.items() for s in ids}

    def _pull(self, holder: NodeId, shard_ids: list[ShardId], done: Future[bool]) -> None:
        """Pool thread: fetch and keep what verifies, release the loads waiting on it,
        then send the reports; never raises."""
        moved: Moved | None = None
        with self._lock:
            self._running.add(done)
        try:
            started = time.perf_counter()
            moved = self._move(holder, shard_ids)
            with self._lock:
                self._counts["shards"] += len(shard_ids)
                self._counts["bytes"] += moved.nbytes
                self._times_s["fetch"] += moved.fetch_s
                self._times_s["accept"] += time.perf_counter() - started - moved.fetch_s
        except Exception as exc:
            logger.warning("pulling %d shards from node %s failed: %s", len(shard_ids), holder, exc)
            with self._lock:
                self._counts["failed"] += 1
        finally:
            self._end(shard_ids, done, moved is not None)
        # The loads waiting on it have gone on: the one-way reports are off their path.
        self._send("report", self._report, moved.landed if moved else Landed([], shard_ids))
        if moved is not None and moved.end_loan is not None:
            self._send("end the loan", moved.end_loan)

    @staticmethod
    def _send(what: str, send: Callable[..., object], *args: object) -> None:
        """A one-way report (the Evictor gives a failed copy's room back, the holder
        unpins a loan's extents); never raises."""
        try:
            send(*args)
        except Exception:
            logger.warning("a pull could not %s", what, exc_info=True)

    def _end(self, shard_ids: list[ShardId], done: Future[bool], ok: bool) -> None:
        with self._lock:
            for shard_id in shard_ids:
                if self._in_flight.get(shard_id) is done:
                    del self._in_flight[shard_id]
            self._running.discard(done)
            self._active -= 1
        done.set_result(ok)

    def wait(
        self,
        shard_ids: Sequence[ShardId],
        timeout_s: float,
        holders: Sequence[NodeId] | None = None,
    ) -> list[PullState]:
        """A load's join: with ``holders`` (each shard's), first start a pull of every
        shard neither held here nor being pulled (:meth:`start`); then wait (at most
        ``timeout_s``) for the running pulls of ``shard_ids``, and say of each whether it
        is held here, the pull it joined failed (or still runs at the deadline), or it
        joined none (one still queued, one that landed and was evicted since, or one this
        call started that failed: the load reads it itself, and may find another copy,
        as it would have with no pull): the load then reads it from its holder. Blocks the
        calling thread only."""
        shard_ids = [ShardId(*s) for s in shard_ids]
        started: dict[ShardId, Future[bool]] = {}
        if holders is not None:
            if len(holders) != len(shard_ids):
                raise ValueError(f"{len(holders)} holders for {len(shard_ids)} shards")
            started = self._start(list(zip(shard_ids, holders, strict=True)))
            with self._lock:
                self._counts["started_by_loads"] += len(set(started.values()))
        with self._lock:
            futures = {s: self._in_flight.get(s) for s in shard_ids}
            joined = {f for f in futures.values() if f is not None and f in self._running}
            self._counts["waits"] += 1
        if joined:
            futures_wait(joined, timeout=timeout_s)
        states = []
        for shard_id in shard_ids:
            future = futures[shard_id]
            done = future is not None and future.done()
            landed = done and future is not None and future.result()
            if self._holds(shard_id):
                states.append(PullState.HELD)
            elif future in joined and not landed and not (done and shard_id in started):
                states.append(PullState.FAILED)
            else:
                states.append(PullState.NONE)
        return states

    def status(self) -> dict[str, float]:
        """Pulls started (and of those, by loads), shards and bytes pulled, pulls failed,
        shards asked for again while in flight or held (joined), loads that waited, shards
        in flight now, and the landed pulls' seconds in the holder's call and the move
        (``fetch_s``) and in verifying and keeping the bytes here (``accept_s``)."""
        with self._lock:
            times = {f"{step}_s": seconds for step, seconds in self._times_s.items()}
            return {**self._counts, "in_flight": len(self._in_flight), **times}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
