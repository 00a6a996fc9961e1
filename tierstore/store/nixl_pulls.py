"""Pulls over NIXL (``pull_transport: "nixl"``): the pulling NodeStore reads the holder's
arena extents straight into extents of its own arena, one one-sided read per pull.

Each NodeStore makes one NIXL agent (UCX backend) and registers its whole arena with it
once, at start. A pull is one call to the holder (:meth:`NixlArena.lend`: the shards'
extents pinned and verified, described to NIXL, and a
:class:`~tierstore.wire_nixl.NixlLoan` back with their metas, all in the call's reply)
and one READ of every extent into extents the puller reserved
(:meth:`NixlArena.read`), which it then verifies and keeps; the puller then ends the
loan (one-way). Neither side copies, and no byte passes through an object
store. Against Ray Direct Transport's NIXL path (``ray.put(..., _tensor_transport=
"nixl")``), which moves the same bytes, this saves RDT's metadata object: a put into the
holder's object store and its fetch by the puller, milliseconds per pull on every size
(docs/benchmarks.md "crossnode"). The books (pins, grants, quarantine) are
:class:`~tierstore.store.loans.ArenaLoans`'.

Deadlines: a read waits at most its deadline; one that failed or timed out is cancelled
(NIXL's release of the transfer), its extents quarantined (it may still land), and the
holder's agent forgotten (a restarted holder has a new one); the pull then fails (the load
reads the shards itself, or recomputes). A lent extent stays pinned until the puller ends
the loan or the loan's time is up (a read after that may find reused bytes: they fail
the checksum and are never kept).

No Ray here: the actor carries the loan in its calls. Threads: :meth:`lend` and
:meth:`end_loan` on the holder's data threads, :meth:`read` on the puller's pull
threads (the agent serializes its own calls: ``NIXL_THREAD_SYNC_STRICT``); one thread of
its own ends overdue loans and releases quarantined extents (it logs and survives its
own errors).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from tierstore.errors import ConfigError
from tierstore.keys import ShardId
from tierstore.store.loans import ArenaLoans
from tierstore.store.pulls import Moved
from tierstore.wire import ShardMeta
from tierstore.wire_nixl import NixlLoan

__all__ = ["NixlArena", "check_nixl"]

logger = logging.getLogger(__name__)

_REAP_PERIOD_S = 0.05
# Polling a read: the first checks come fast (a small read lands in tens of
# microseconds on one host), then back off so a long one costs no core.
_POLL_FIRST_S = 50e-6
_POLL_MAX_S = 1e-3


def check_nixl() -> None:
    """Raise ConfigError, saying how to install it, where NIXL does not import."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            'pull_transport "nixl" needs NIXL on every node: pip install "tierstore[nixl]" '
            f"(the nixl and nixl-cu12 packages); here: {exc}. Or set pull_transport to "
            '"object_store"'
        ) from exc


# The agent's progress thread sleeps this long between rounds. nixl 1.5's Python agent
# sets no pause (``pthrDelay = 0``): its thread spins, a core per agent; with this one
# an idle agent costs almost nothing and reads on one host are as fast
# (docs/benchmarks.md "crossnode"). The holder's side of a read needs that thread.
_PROGRESS_PAUSE_US = 100
_MAKING_AGENT = threading.Lock()


def _make_agent(name: str) -> Any:
    """A NIXL agent (UCX, calls serialized by NIXL) whose progress thread pauses
    :data:`_PROGRESS_PAUSE_US` between rounds: the agent's native config is given that
    pause as the agent is made (nixl's Python wrapper sets none of its own)."""
    from nixl import _api

    config = _api.nixl_agent_config(
        backends=["UCX"], sync_mode=_api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    bind: Any = getattr(_api, "nixlBind", None)
    native = getattr(bind, "nixlAgent", None)
    if native is None:  # another nixl than 1.5's layout: its own defaults
        logger.warning("nixl's native agent was not found: its progress thread may spin")
        return _api.nixl_agent(name, config)

    def paused(agent_name: str, config: Any) -> Any:
        config.pthrDelay = _PROGRESS_PAUSE_US
        return native(agent_name, config)

    with _MAKING_AGENT:
        bind.nixlAgent = paused
        try:
            return _api.nixl_agent(name, config)
        finally:
            bind.nixlAgent = native


class _Lent(NamedTuple):
    offsets: list[int]
    until: float  # monotonic: ended then if the puller has not ended it


class NixlArena:
    """One NodeStore's NIXL agent over its arena: lends extents, and reads others'."""

    def __init__(self, loans: ArenaLoans, arena: np.ndarray, node: str, timeout_s: float):
        """``arena``: the node's whole arena (writable), registered here once;
        ``timeout_s``: a loan's life, and a read's longest wait."""
        check_nixl()
        self._loans = loans
        self._timeout_s = timeout_s
        self._base = int(arena.ctypes.data)
        self._arena = arena  # kept mapped while the agent knows it
        # One name per process: a restarted NodeStore's agent is a new one to its peers.
        self._agent = _make_agent(f"tierstore-{node[:16]}-{uuid.uuid4().hex[:8]}")
        self._registration = self._agent.register_memory(
            [(self._base, arena.nbytes, 0, "")], mem_type="cpu"
        )
        self._meta = bytes(self._agent.get_agent_metadata())
        self._lock = threading.Lock()
        self._lent: dict[int, _Lent] = {}
        self._loan_ids = itertools.count(1)
        self._remote: dict[str, bytes] = {}  # agents added: name -> their metadata
        self._counts = {"lent_in_place": 0, "read_in_place": 0, "loans_overdue": 0}
        self._stop = threading.Event()
        threading.Thread(target=self._reap_loop, name="tierstore-nixl-loans", daemon=True).start()

    # ---- the holder's side ------------------------------------------------------------------
    def lend(self, shard_ids: Sequence[ShardId]) -> tuple[NixlLoan, list[ShardMeta]]:
        """The shards' extents for another node to read, pinned until :meth:`end_loan`
        or ``timeout_s``. Raises ChunkNotFoundError (nothing pinned) if one is not in
        memory, ChunkCorruptError if one fails its checksum. Data threads."""
        lent = self._loans.lend(shard_ids)
        offsets = [offset for offset, _ in lent]
        try:
            descs = self._agent.get_xfer_descs(
                [(self._base + offset, meta.nbytes, 0) for offset, meta in lent], mem_type="cpu"
            )
            blob = bytes(self._agent.get_serialized_descs(descs))
        except BaseException:
            self._loans.end_loan(offsets)
            raise
        with self._lock:
            loan_id = next(self._loan_ids)
            self._lent[loan_id] = _Lent(offsets, time.monotonic() + self._timeout_s)
            self._counts["lent_in_place"] += len(lent)
        return NixlLoan(loan_id, self._agent.name, self._meta, blob), [m for _, m in lent]

    def end_loan(self, loan_id: int) -> None:
        """The puller is done with the loan's extents (an unknown or ended one: nothing)."""
        with self._lock:
            lent = self._lent.pop(loan_id, None)
        if lent is not None:
            self._loans.end_loan(lent.offsets)

    # ---- the puller's side ------------------------------------------------------------------
    def read(
        self, loan: NixlLoan, shards: Sequence[tuple[ShardId, ShardMeta]], started: float
    ) -> Moved:
        """Read the loan's extents into extents reserved here and keep what verifies
        (the Moved says which, for the Evictor). ``started``: the pull's start
        (``perf_counter``); the read waits until ``timeout_s`` after it at most. Raises
        if the read failed or timed out (nothing kept, the extents quarantined):
        TimeoutError, or ConnectionError (the holder gone, a refused read). A pull
        thread."""
        metas = [meta for _, meta in shards]
        offsets = self._loans.reserve(metas)
        handle = None
        try:
            self._know(loan.agent, loan.agent_meta)
            local = self._agent.get_xfer_descs(
                [(self._base + o, m.nbytes, 0) for o, m in zip(offsets, metas, strict=True)],
                mem_type="cpu",
            )
            remote = self._agent.deserialize_descs(loan.descs)
            handle = self._agent.initialize_xfer("READ", local, remote, loan.agent, b"")
            self._wait(handle, self._agent.transfer(handle), started + self._timeout_s)
        except (TimeoutError, ConnectionError):
            self._abandon(handle, loan.agent, offsets)
            raise
        except BaseException as exc:  # NIXL's own errors: no endpoint, a refused read
            self._abandon(handle, loan.agent, offsets)
            if not isinstance(exc, Exception):
                raise
            raise ConnectionError(f"NIXL read from {loan.agent} failed: {exc!r}") from exc
        fetched = time.perf_counter()
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # the read is done: its bytes are kept all the same
            logger.warning("releasing a finished NIXL read failed", exc_info=True)
        landed = self._loans.keep(shards, offsets)
        with self._lock:
            self._counts["read_in_place"] += len(shards)
        return Moved(sum(meta.nbytes for meta in metas), fetched - started, landed)

    def _know(self, agent: str, meta: bytes) -> None:
        """Add the holder's agent (again, if its metadata changed)."""
        with self._lock:
            if self._remote.get(agent) == meta:
                return
            if agent in self._remote:
                self._agent.remove_remote_agent(agent)
            self._agent.add_remote_agent(meta)
            self._remote[agent] = meta

    def _wait(self, handle: Any, state: str, deadline: float) -> None:
        pause = _POLL_FIRST_S
        while state != "DONE":
            if state == "ERR":
                raise ConnectionError("the NIXL read failed (the holder may be gone)")
            if time.perf_counter() >= deadline:
                raise TimeoutError(f"the NIXL read outlived its {self._timeout_s} s deadline")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
            state = self._agent.check_xfer_state(handle)

    def _abandon(self, handle: Any, agent: str, offsets: list[int]) -> None:
        """A read that failed: cancel it, quarantine its extents, forget its agent."""
        self._loans.quarantine(offsets)
        try:
            if handle is not None:
                self._agent.release_xfer_handle(handle)  # cancels one still running
        except Exception:
            logger.warning("cancelling a NIXL read failed", exc_info=True)
        with self._lock:
            known = self._remote.pop(agent, None)
        try:
            if known is not None:
                self._agent.remove_remote_agent(agent)
        except Exception:
            logger.warning("forgetting NIXL agent %s failed", agent, exc_info=True)

    # ---- loans' ends ------------------------------------------------------------------------
    def _reap_loop(self) -> None:
        while not self._stop.wait(_REAP_PERIOD_S):
            try:
                self._end_overdue()
                self._loans.release_due()
            except Exception:
                logger.warning("ending NIXL loans failed; retrying", exc_info=True)

    def _end_overdue(self) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = [loan_id for loan_id, lent in self._lent.items() if lent.until <= now]
        for loan_id in overdue:
            logger.warning(
                "NIXL loan %d outlived its %s s; its extents unpinned", loan_id, self._timeout_s
            )
            with self._lock:
                self._counts["loans_overdue"] += 1
            self.end_loan(loan_id)

    def status(self) -> dict[str, int]:
        """Shards lent and read in place since start, loans that outlived their time,
        loans open now, and extents quarantined now."""
        with self._lock:
            return {**self._counts, "nixl_loans": len(self._lent), **self._loans.status()}

    def close(self) -> None:
        """The NodeStore stops: no more reads of this arena (a peer's read in flight
        fails, and its puller quarantines what it reserved), before the arena goes."""
        self._stop.set()
        registration, self._registration = self._registration, None
        try:
            if registration is not None:
                self._agent.deregister_memory(registration)
        except Exception:
            logger.warning("deregistering the arena from NIXL failed", exc_info=True)
