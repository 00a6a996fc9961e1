"""A thread that hands queued items to one call in batches.

Two users. The worker's store commits: a store gathered into arena extents is done, for
vLLM, once its bytes are there: its source blocks may be reused, and the extents stay
this worker's until committed. So the worker reports the job done at once and queues the
commit (key, extent, digest) here: whatever is queued when the thread is free goes to
the NodeStore in one call, so a burst of small jobs costs one round trip and no job
waits for another's acknowledgement (issue 10: "commits ... in one batched call that is
acknowledged later"). And the NodeStore's write-through after a store: written to disk
on a thread of its own, so the next commit never waits behind the last one's disk
writes.

Threads: :meth:`put` on any thread, never blocks; ``send`` runs on this queue's own
thread, which logs and survives its errors; :meth:`wait_idle` blocks its caller (tests,
benchmarks, shutdown) until every item queued so far was sent and answered.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BatchQueue(Generic[T]):
    def __init__(
        self,
        send: Callable[[list[T]], None],
        name: str,
        max_batch: int = 64,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self._send = send  # handles its items' failures itself; an exception is logged
        self._on_start = on_start  # run first on the thread (e.g. to leave vLLM's cores)
        self._max_batch = max_batch
        self._items: list[T] = []
        self._sending = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: T) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the queue is closed")
            self._items.append(item)
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """True once everything queued so far was sent; False at the deadline."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._sending, timeout_s)

    def close(self, timeout_s: float) -> None:
        """Send what is queued (up to ``timeout_s``), then stop the thread."""
        if not self.wait_idle(timeout_s):
            logger.warning("%d queued items not sent before shutdown", len(self._items))
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    @property
    def queued(self) -> int:
        """Items queued and not taken for sending yet."""
        with self._cond:
            return len(self._items)

    def _run(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception:
                logger.warning("%s: start-up hook failed", self._thread.name, exc_info=True)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._items or self._closed)
                if not self._items:
                    return  # closed
                batch = self._items[: self._max_batch]
                del self._items[: self._max_batch]
                self._sending = True
            try:
                self._send(batch)
            except Exception:
                logger.error("sending %d queued items failed", len(batch), exc_info=True)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()
