"""The scheduler's line to the Evictor: every Ray call runs on one background thread.

The scheduler thread only enqueues; the thread issues the actor calls, waits for the
answers and hands them to callbacks. A dead Evictor turns lookups into misses (logged),
never into a blocked or crashed scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import ray

from tierstore.control.index import LookupAnswer, LookupState
from tierstore.keys import ChunkKey, Namespace

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0  # an answer later than this is treated as a failure
_STOP = object()

Answers = list[LookupAnswer]


class EvictorChannel:
    def __init__(self, evictor: ray.actor.ActorHandle) -> None:
        self._evictor = evictor
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
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
        args = (namespace, keys, holder, lease_ttl_s, node)
        self._queue.put(("lookup", args, on_answers, misses))

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, ttl_s: float
    ) -> None:
        self._queue.put(("extend_leases", (namespace, keys, holder, ttl_s), None, None))

    def release(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        loaded: int = 0,
        node: str | None = None,
    ) -> None:
        """``loaded``: the keys were loaded into this engine (on ``node``), not given up."""
        self._queue.put(("release", (namespace, keys, holder, loaded, node), None, None))

    def release_holder(self, holder: str) -> None:
        self._queue.put(("release_holder", (holder,), None, None))

    def poll(self, method: str, args: tuple[Any, ...], on_done: Callable[[Any], None]) -> None:
        """A read-only Evictor call (status, events); ``on_done`` gets None if it failed."""
        self._queue.put((method, args, on_done, None))

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=_CALL_TIMEOUT_S)

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # drain: everything queued so far goes out together
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in batch)
            self._send([item for item in batch if item is not _STOP])
            if stop:
                return

    def _send(
        self, batch: list[tuple[str, tuple[Any, ...], Callable[[Any], None] | None, Any]]
    ) -> None:
        """Each item: (method, args, callback, what the callback gets if the call fails)."""
        calls = []
        for method, args, on_done, fallback in batch:
            try:
                ref = getattr(self._evictor, method).remote(*args)
            except Exception:
                logger.warning("Evictor call %s failed to send", method, exc_info=True)
                ref = None
            calls.append((ref, on_done, fallback, method))
        for ref, on_done, fallback, method in calls:
            result: Any = None
            if ref is not None:
                try:
                    result = ray.get(ref, timeout=_CALL_TIMEOUT_S)
                except Exception:
                    logger.warning(
                        "Evictor call %s failed; %s",
                        method,
                        "its lookups count as misses" if on_done else "dropped",
                        exc_info=True,
                    )
            if on_done is not None:
                on_done(result if result is not None else fallback)
