"""The scheduler's line to the Evictor: every remote call runs on one background thread.

The scheduler thread only enqueues; the thread sends the calls, waits for the answers
and hands them to callbacks. A dead Evictor turns lookups into misses (logged), never
into a blocked or crashed scheduler; a callback that raises is logged and counted, and
the thread goes on with the next call.

The queue carries typed calls (a function of :class:`EvictorCalls`), never method names:
the Evictor's client is injected by the composition root (``tierstore.spec``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from tierstore.keys import ChunkKey, Namespace
from tierstore.vllm.cpu_affinity import leave_compute_cores
from tierstore.wire import EventBatch, LookupAnswer, LookupState, Reply

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 30.0  # the thread's last batch has at most the client's deadline
_STOP = object()

Answers = list[LookupAnswer]
T = TypeVar("T")


class EvictorCalls(Protocol):
    """What the scheduler asks of the Evictor (its client): each call returns at once."""

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


class EvictorChannel:
    def __init__(self, evictor: EvictorCalls) -> None:
        self._evictor = evictor
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.failed_callbacks = 0  # callbacks that raised (counted on the thread)
        self._thread = threading.Thread(target=self._run, name="tierstore-evictor", daemon=True)
        self._thread.start()

    # ---- called from the scheduler thread: never block ------------------------------------
    def lookup(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        lease_ttl_s: float,
        on_answers: Callable[[Answers], None],
        node: str | None = None,
    ) -> None:
        """``node``: the engine's own node, so the Evictor can name a replica there."""
        misses = [LookupAnswer(LookupState.MISS)] * len(keys)
        self._queue.put(
            _Call(
                lambda e: e.lookup(namespace, keys, holder, lease_ttl_s, node),
                "lookup",
                on_answers,
                misses,
            )
        )

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, ttl_s: float
    ) -> None:
        self._queue.put(
            _Call(lambda e: e.extend_leases(namespace, keys, holder, ttl_s), "extend_leases")
        )

    def release(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        loaded: int = 0,
        node: str | None = None,
    ) -> None:
        """``loaded``: the keys were loaded into this engine (on ``node``), not given up."""
        self._queue.put(
            _Call(lambda e: e.release(namespace, keys, holder, loaded, node), "release")
        )

    def release_holder(self, holder: str) -> None:
        self._queue.put(_Call(lambda e: e.release_holder(holder), "release_holder"))

    def poll(
        self,
        call: Callable[[EvictorCalls], Reply[T]],
        on_done: Callable[[T | None], None],
        what: str = "poll",
    ) -> None:
        """A read-only Evictor call (status, events); ``on_done`` gets None if it failed."""
        self._queue.put(_Call(call, what, on_done, None))

    def sibling(self) -> EvictorChannel:
        """A channel (and thread) of its own to the same Evictor: its calls never queue
        behind this one's. The thread waits for a batch's answers before it sends the
        next, so a lookup queued while a poll is in flight would wait for both."""
        return EvictorChannel(self._evictor)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=_CLOSE_TIMEOUT_S)

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        leave_compute_cores()
        while True:
            batch = [self._queue.get()]
            while True:  # drain: everything queued so far goes out together
                try:
                    batch.append(self._queue.get_nowait())
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
                logger.warning("Evictor call %s failed to send", call.what, exc_info=True)
                reply = None
            sent.append((call, reply))
        for call, reply in sent:
            result: Any = None
            if reply is not None:
                try:
                    result = reply.result()
                except Exception:
                    logger.warning(
                        "Evictor call %s failed; %s",
                        call.what,
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
