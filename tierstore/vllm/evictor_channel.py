"""The scheduler's line to the Evictor: every remote call runs on a background thread,
one per Evictor shard.

The scheduler thread only enqueues; a shard's thread sends its calls, waits for the
answers and hands them to callbacks. A dead Evictor shard turns lookups into misses
(logged), never into a blocked or crashed scheduler, and never delays another shard's
answers; a callback that raises is logged and counted, and the thread goes on with the
next call.

The queue carries typed calls (a function of :class:`EvictorCalls`), never method names:
the Evictor shards' clients are injected by the composition root (``tierstore.spec``).

Sharded Evictors (``evictor_shards``): a prefix tree lives on one shard, the one of its
root (:func:`tierstore.keys.root_of`, :func:`~tierstore.keys.shard_of`). A request's
lookups, lease extensions and releases carry its root and go to that shard only: one
call per request and step, to one shard, never a cross-shard message. A holder's leases
are released on every shard; polls go to the shard the caller names.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from tierstore.keys import ChunkKey, Namespace, shard_of
from tierstore.vllm.cpu_affinity import leave_compute_cores
from tierstore.wire import EventBatch, LookupAnswer, LookupState, Reply

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 30.0  # the thread's last batch has at most the client's deadline
_STOP = object()

Answers = list[LookupAnswer]
T = TypeVar("T")


class EvictorCalls(Protocol):
    """What the scheduler asks of one Evictor shard (its client): each call returns at
    once."""

    def lookup(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        lease_ttl_s: float,
        node_id: str | None = None,
    ) -> Reply[list[LookupAnswer]]: ...

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, ttl_s: float
    ) -> Reply[None]: ...

    def release(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        loaded: int = 0,
        node_id: str | None = None,
    ) -> Reply[None]: ...

    def release_holder(self, holder: str) -> Reply[None]: ...

    def events_since(self, after: int, namespace: Namespace) -> Reply[EventBatch]: ...

    def presence(self, namespace: Namespace) -> Reply[EventBatch]: ...

    def status(self) -> Reply[dict[str, Any]]: ...


@dataclass
class _Call(Generic[T]):
    send: Callable[[EvictorCalls], Reply[T]]
    what: str
    on_done: Callable[[T], None] | None = None
    fallback: Any = None  # what ``on_done`` gets if the call fails
    shard: int = 0  # the Evictor shard it goes to


class EvictorChannel:
    def __init__(self, evictors: EvictorCalls | Sequence[EvictorCalls]) -> None:
        """``evictors``: one client per Evictor shard, index = shard (one client alone:
        one shard, as with ``evictor_shards`` 1). Each shard gets a thread of its own
        (a *lane*): a slow or restarting shard never delays another shard's answers."""
        clients = list(evictors) if isinstance(evictors, Sequence) else [evictors]
        if not clients:
            raise ValueError("an Evictor channel needs at least one Evictor shard")
        self._evictors = clients
        self._lanes = [_Lane(client, shard) for shard, client in enumerate(clients)]

    @property
    def failed_callbacks(self) -> int:
        """Callbacks that raised (counted on the lanes' threads)."""
        return sum(lane.failed_callbacks for lane in self._lanes)

    @property
    def shards(self) -> int:
        """How many Evictor shards there are (``evictor_shards``)."""
        return len(self._evictors)

    def _shard(self, root: int) -> int:
        return shard_of(root, len(self._evictors))

    # ---- called from the scheduler thread: never block ------------------------------------
    def lookup(  # noqa: PLR0913 - the Evictor call's arguments, and where it goes
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        lease_ttl_s: float,
        on_answers: Callable[[Answers], None],
        node: str | None = None,
        root: int = 0,
    ) -> None:
        """``node``: the engine's own node, so the Evictor can name a replica there.
        ``root``: the root of the keys' prefix tree (their request's); the call goes to
        its shard (0: not known, shard 0)."""
        misses = [LookupAnswer(LookupState.MISS)] * len(keys)
        self._put(
            _Call(
                lambda e: e.lookup(namespace, keys, holder, lease_ttl_s, node),
                "lookup",
                on_answers,
                misses,
                self._shard(root),
            )
        )

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, ttl_s: float, root: int = 0
    ) -> None:
        """To ``root``'s shard, which holds the leases (:meth:`lookup`)."""
        self._put(
            _Call(
                lambda e: e.extend_leases(namespace, keys, holder, ttl_s),
                "extend_leases",
                shard=self._shard(root),
            )
        )

    def release(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        loaded: int = 0,
        node: str | None = None,
        root: int = 0,
    ) -> None:
        """``loaded``: the keys were loaded into this engine (on ``node``), not given up.
        To ``root``'s shard, which holds the leases (:meth:`lookup`)."""
        self._put(
            _Call(
                lambda e: e.release(namespace, keys, holder, loaded, node),
                "release",
                shard=self._shard(root),
            )
        )

    def release_holder(self, holder: str) -> None:
        """Every lease of ``holder``, on every shard."""
        for shard in range(len(self._evictors)):
            self._put(_Call(lambda e: e.release_holder(holder), "release_holder", shard=shard))

    def poll(
        self,
        call: Callable[[EvictorCalls], Reply[T]],
        on_done: Callable[[T | None], None],
        what: str = "poll",
        shard: int = 0,
    ) -> None:
        """A read-only call (status, events) to Evictor ``shard``; ``on_done`` gets None
        if it failed."""
        self._put(_Call(call, what, on_done, None, shard))

    def sibling(self) -> EvictorChannel:
        """A channel (and threads) of its own to the same Evictor shards: its calls never
        queue behind this one's. A lane waits for a batch's answers before it sends the
        next, so a lookup queued while a poll is in flight would wait for both."""
        return EvictorChannel(self._evictors)

    def close(self) -> None:
        for lane in self._lanes:
            lane.stop()
        for lane in self._lanes:
            lane.join()

    def _put(self, call: _Call[Any]) -> None:
        self._lanes[call.shard].queue.put(call)


class _Lane:
    """One Evictor shard's queue and the thread that sends its calls."""

    def __init__(self, evictor: EvictorCalls, shard: int) -> None:
        self._evictor = evictor
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.failed_callbacks = 0  # callbacks that raised (counted on the thread)
        name = "tierstore-evictor" if shard == 0 else f"tierstore-evictor-{shard}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.queue.put(_STOP)

    def join(self) -> None:
        self._thread.join(timeout=_CLOSE_TIMEOUT_S)

    def _run(self) -> None:
        leave_compute_cores()
        while True:
            batch = [self.queue.get()]
            while True:  # drain: everything queued so far goes out together
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in batch)
            try:
                self._send([item for item in batch if item is not _STOP])
            except Exception:  # a bug of ours: the next batch must still go out
                logger.error("Evictor channel: a batch failed", exc_info=True)
            if stop:
                return

    def _send(self, batch: list[_Call[Any]]) -> None:
        """Send the whole batch, then wait for each answer in turn (at most its deadline)."""
        sent: list[tuple[_Call[Any], Reply[Any] | None]] = []
        for call in batch:
            try:
                reply: Reply[Any] | None = call.send(self._evictor)
            except Exception:
                logger.warning(
                    "Evictor call %s to shard %d failed to send",
                    call.what,
                    call.shard,
                    exc_info=True,
                )
                reply = None
            sent.append((call, reply))
        for call, reply in sent:
            result: Any = None
            if reply is not None:
                try:
                    result = reply.result()
                except Exception:
                    logger.warning(
                        "Evictor call %s to shard %d failed; %s",
                        call.what,
                        call.shard,
                        "its lookups count as misses" if call.on_done else "dropped",
                        exc_info=True,
                    )
            if call.on_done is not None:
                self._answer(call, result if result is not None else call.fallback)

    def _answer(self, call: _Call[Any], result: Any) -> None:
        try:
            call.on_done(result)  # type: ignore[misc]
        except Exception:
            self.failed_callbacks += 1
            logger.error("a callback of Evictor call %s raised", call.what, exc_info=True)
