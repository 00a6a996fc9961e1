"""Pulls over Ray Direct Transport with NIXL (``pull_transport: "nixl"``): the pulling
NodeStore reads the holder's arena extents straight into extents of its own arena.

The holder registers its whole arena with NIXL once, at start; a pull asks it to lend
the shards (:meth:`NixlPulls.lend`: pinned, verified, and put as an RDT object of views
of the extents, with no copy), and the puller registers its own arena likewise, points
the object at extents it reserved (``set_target_for_ref``) and reads them in one
one-sided transfer. Against the object store (``pull_transport: "object_store"``) this
saves the holder's put (a copy into its object store), the object manager's move
between the two object stores, and the puller's copy into its arena (docs/benchmarks.md
"crossnode"). The books (pins, grants, quarantine) are
:class:`~tierstore.store.loans.ArenaLoans`'.

Deadlines: the holder's call and the read each wait at most the pull's timeout; a read
that failed or timed out leaves its extents quarantined (the transfer may still land),
and the pull fails (the load reads the shards itself, or recomputes). A lent extent is
pinned until Ray says the puller's reference is gone, or the pull's timeout has passed
(a late read then finds reused bytes, which fail its checksum: never kept).

Shards a holder has only on disk are lent through the object store in the same reply
(one put of what it reads), so a puller handles both.

Threads: :meth:`lend` on the holder's data threads, :meth:`pull` on the puller's pull
threads; one thread of its own ends loans and releases quarantined extents (it logs
and survives its own errors).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import ray

from tierstore.errors import ChunkNotFoundError, ConfigError
from tierstore.keys import ShardId
from tierstore.store.loans import ArenaLoans
from tierstore.store.pulls import Moved
from tierstore.wire import ShardMeta

__all__ = ["IN_PLACE", "NixlPulls", "check_nixl"]

logger = logging.getLogger(__name__)

IN_PLACE = "nixl"  # a lend's reply: extents to read in place (else "object_store")
_REAP_PERIOD_S = 0.01


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


class _Loan(NamedTuple):
    tensors: list[Any]  # the RDT object's tensors: Ray tracks them by identity
    offsets: list[int]
    until: float  # monotonic: ended then even if Ray still holds them


class NixlPulls:
    """One NodeStore's NIXL pulls, both as holder and as puller."""

    def __init__(self, loans: ArenaLoans, arena: np.ndarray, timeout_s: float) -> None:
        """``arena``: the node's whole arena (writable), registered with NIXL here."""
        check_nixl()
        import torch
        from ray.experimental import register_nixl_memory

        self._loans = loans
        self._timeout_s = timeout_s
        self._arena = torch.from_numpy(arena)
        register_nixl_memory(self._arena)
        self._lock = threading.Lock()
        self._lent: list[_Loan] = []
        # Shards lent in place, and read in place into this node's arena, since start.
        self._counts = {"lent_in_place": 0, "read_in_place": 0}
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="tierstore-loans", daemon=True)
        self._reaper.start()

    # ---- the holder's side ------------------------------------------------------------------
    def lend(
        self, shard_ids: list[ShardId], read: Callable[[list[ShardId]], tuple[Any, list[ShardMeta]]]
    ) -> tuple[str, list[ray.ObjectRef], list[ShardMeta]]:
        """The shards for another node: extents in place (:data:`IN_PLACE`, an RDT
        object of their views), or, if one is not in memory, ``read``'s object-store
        ref of them all ("object_store"). Data threads."""
        try:
            lent = self._loans.lend(shard_ids)
        except ChunkNotFoundError:  # one is on disk only: read them all, put them
            ref, metas = read(shard_ids)
            return "object_store", [ref], metas
        offsets = [offset for offset, _ in lent]
        tensors = [self._arena[offset : offset + meta.nbytes] for offset, meta in lent]
        try:
            ref = ray.put(tensors, _tensor_transport="nixl")
        except BaseException:
            self._loans.end_loan(offsets)
            raise
        with self._lock:
            self._lent.append(_Loan(tensors, offsets, time.monotonic() + self._timeout_s))
            self._counts["lent_in_place"] += len(lent)
        return IN_PLACE, [ref], [meta for _, meta in lent]

    # ---- the puller's side ------------------------------------------------------------------
    def pull(
        self,
        shard_ids: list[ShardId],
        lend: Callable[[float], tuple[str, list[ray.ObjectRef], list[ShardMeta]]],
        accept: Callable[[list[tuple[ShardId, ShardMeta]], list[np.ndarray]], None],
    ) -> Moved:
        """A pull thread: ``lend`` (the holder's call, given its timeout), then read the
        extents into extents reserved here and keep what verifies (or, for an
        object-store reply, ``accept`` its arrays). Raises if the call or the read
        failed or outlived the timeout; nothing is kept then."""
        started = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        how, refs, metas = lend(self._timeout_s)
        if len(metas) != len(shard_ids) or len(refs) != 1:
            raise ValueError(f"{len(metas)} metas, {len(refs)} objects: {len(shard_ids)} shards")
        shards = list(zip(shard_ids, metas, strict=True))
        nbytes = sum(meta.nbytes for meta in metas)
        if how != IN_PLACE:
            views = list(ray.get(refs[0], timeout=max(0.0, deadline - time.monotonic())))
            fetched = time.perf_counter()
            accept(shards, views)
            return Moved(nbytes, fetched - started)
        offsets = self._loans.reserve(metas)
        try:
            targets = [
                self._arena[offset : offset + meta.nbytes]
                for offset, meta in zip(offsets, metas, strict=True)
            ]
            ray.experimental.set_target_for_ref(refs[0], targets)
            ray.get(refs[0], timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:
            self._loans.quarantine(offsets)
            raise
        fetched = time.perf_counter()
        del refs  # the holder may end its loan now
        self._loans.keep(shards, offsets)
        with self._lock:
            self._counts["read_in_place"] += len(shards)
        return Moved(nbytes, fetched - started)

    # ---- loans' ends ----------------------------------------------------------------------------
    def _reap_loop(self) -> None:
        while not self._stop.wait(_REAP_PERIOD_S):
            try:
                self._end_loans()
                self._loans.release_due()
            except Exception:
                logger.warning("ending NIXL loans failed; retrying", exc_info=True)

    def _end_loans(self) -> None:
        """End each loan whose tensors Ray has let go of, or whose time is up."""
        from ray.experimental import wait_tensor_freed

        now = time.monotonic()
        with self._lock:
            loans, self._lent = self._lent, []
        ending: list[_Loan] = []
        for loan in loans:
            if now >= loan.until or all(_freed(wait_tensor_freed, t) for t in loan.tensors):
                ending.append(loan)
            else:
                with self._lock:
                    self._lent.append(loan)
        for loan in ending:
            if now >= loan.until:
                logger.warning("a NIXL loan of %d extents outlived its deadline", len(loan.offsets))
            self._loans.end_loan(loan.offsets)

    def status(self) -> dict[str, int]:
        """Shards lent and read in place since start, loans open now, and extents
        quarantined now."""
        with self._lock:
            return {**self._counts, "nixl_loans": len(self._lent), **self._loans.status()}

    def close(self) -> None:
        self._stop.set()


def _freed(wait: Callable[..., None], tensor: Sequence[Any]) -> bool:
    try:
        wait(tensor, timeout=0)
    except TimeoutError:
        return False
    return True
