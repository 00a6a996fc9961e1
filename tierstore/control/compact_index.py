"""The chunk index in flat arrays: :class:`CompactChunkIndex`, ChunkIndex's API in C.

:class:`~tierstore.control.index.ChunkIndex` keeps a few Python objects per chunk (its
chunk, shards, unit, heap entries, policy entry): about 1.2 KB each, and every decision
walks them in the interpreter. This index makes the same decisions, in the same order,
from flat arrays in a C extension (``compact_index.c``, built as
``tierstore.control._compact_index``):

- chunks are found by a 64-bit hash of ``(namespace, boundary)`` in one open-addressing
  table, each hit confirmed against the key bytes; a unit through any of its chunks
  (they share its boundary), so units need no table of their own; namespaces, nodes and
  lease holders are interned once, as small integers;
- a chunk's shards are 12-byte records, in the chunk's own 40-byte record when it has
  one rank, else a run in a pool; units are 32-byte records; the prefix tree's edges,
  the waits of units whose parent is absent, and the leases are pooled records linked
  by index;
- the candidate heaps per (node, tier), the parked units and their wake-ups are the
  reference's, as arrays of ``(rank, unit)``.

``ChunkIndex`` is its reference model: ``tests/control/test_compact_index.py`` runs
random workloads on both and requires the same answers, actions (in order), stats and
state. What is ported: the LRU policy, nodes, stores shard by shard and by unit (room
by demotion, dropping tails, a store's last-resort demotion, write-through, watermarks),
lookups with leases and promotion, promotions reported, disk write failures, restore,
forget_shards and corruption, forget_node, and replicas of hot chunks (started after
``replicate_after_loads`` loads from elsewhere, landed or failed, evicted first on their
node, dropped with their chunk, adopted when their chunk's holder is lost, served by
lookups and ``locate``). Not ported: the ARC policy (its two segments, ghost lists and
adaptive target are a second policy engine in C): the constructor refuses it, and
:func:`make_index` then builds the reference index instead.

The per-(chunk, node) load counts that decide when a replica is made stay in Python, as
ChunkIndex's (:class:`~tierstore.control.index_model.RemoteLoads`): a few thousand
entries, touched once per load.

Limits the reference has not: a chunk of at most 2**24 - 1 ranks (an offer of a larger
world is refused as one whose rank is outside it), 2**24 namespaces and 2**24 nodes.

The extension is optional at install (no C compiler: :func:`available` is False and
:func:`make_index` builds a ChunkIndex, the same decisions at the reference's speed).

Threading: single-threaded, as ChunkIndex: the Evictor serialises every call, which
holds the GIL throughout. HIT answers and ShardIds are built in C; an answer's ``where``
dict is new per answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import islice
from typing import Any

from tierstore.control.index import (
    Actions,
    AdmitResult,
    ChunkId,
    ChunkIndex,
    IndexStats,
    LookupAnswer,
    LookupState,
    NodeActions,
    ShardOffer,
    UnitAdmitResult,
    UnitId,
    UnitOffer,
    Watermarks,
)
from tierstore.control.index_model import RemoteLoads
from tierstore.errors import UnknownNodeError
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName

logger = logging.getLogger(__name__)

try:
    from tierstore.control import _compact_index
except ImportError:  # built without a C compiler: make_index falls back to ChunkIndex
    _compact_index = None  # type: ignore[assignment]

_RESTORE_GRACE_HOLDER = "tierstore/restore-grace"  # as ChunkIndex's
# IndexStats fields the C core counts, in the order of its drain_counts() tuple.
_CORE_COUNTS = (
    "stored_chunks",
    "hits",
    "misses",
    "evicted_chunks",
    "demoted_shards",
    "promoted_shards",
    "disk_hits",
    "refused_promotions",
    "skipped_stores",
    "admit_calls",
    "admitted_units",
    "replicated_chunks",
    "hits_same_node",
    "hits_other_node",
)


def available() -> bool:
    """The C extension was built and imports."""
    return _compact_index is not None


class CompactChunkIndex:
    """ChunkIndex's public API and decisions, state in flat arrays (see the module doc).

    Single-threaded: the Evictor serialises every call. Built as
    ``CompactChunkIndex(policy, watermarks, replicate_after_loads)``; only the LRU policy
    is supported (ValueError otherwise).
    """

    def __init__(
        self,
        policy: str = "lru",
        watermarks: Watermarks | None = None,
        replicate_after_loads: int = 0,
    ) -> None:
        if _compact_index is None:
            raise ValueError("the compact index's C extension is not built (no C compiler?)")
        if policy != "lru":
            raise ValueError(f"the compact index supports the 'lru' policy only, not {policy!r}")
        if replicate_after_loads < 0:
            raise ValueError(
                f"replicate_after_loads: expected >= 0 (0 = never), got {replicate_after_loads!r}"
            )
        self._replicate_after = replicate_after_loads
        self._remote_loads = RemoteLoads(replicate_after_loads)
        marks = watermarks or Watermarks()
        self._core = _compact_index.Core(
            marks.high,
            marks.low,
            ShardId,
            LookupAnswer,
            UnitId,
            LookupState.HIT,
            LookupAnswer(LookupState.MISS),
            LookupAnswer(LookupState.PENDING),
            TierName.CPU,
            TierName.DISK,
        )
        self._registered: set[NodeId] = set()
        self.stats = IndexStats()

    # ---- bookkeeping -----------------------------------------------------------------
    def _sync(self) -> None:
        """Add what the core counted since the last call to :attr:`stats`."""
        for name, n in zip(_CORE_COUNTS, self._core.drain_counts(), strict=True):
            if n:
                setattr(self.stats, name, getattr(self.stats, name) + n)

    @staticmethod
    def _actions(raw: dict[NodeId, tuple[list[Any], ...]]) -> Actions:
        """The core's ``node -> [drop, demote, promote, persist, push]`` as NodeActions."""
        return {
            node: NodeActions(drop, demote, promote, persist, push)
            for node, (drop, demote, promote, persist, push) in raw.items()
        }

    def _known(self, node: NodeId) -> None:
        if node not in self._registered:
            raise UnknownNodeError(f"node {node!r} is not registered with the Evictor")

    # ---- nodes -----------------------------------------------------------------------
    def register_node(self, node: NodeId, cpu_bytes: int, disk_bytes: int = 0) -> None:
        """As :meth:`ChunkIndex.register_node`."""
        self._core.register_node(node, cpu_bytes, disk_bytes)
        self._registered.add(node)

    def resize_node(self, node: NodeId, cpu_bytes: int, disk_bytes: int, now: float) -> Actions:
        """As :meth:`ChunkIndex.resize_node`."""
        self._known(node)
        raw = self._core.resize_node(node, cpu_bytes, disk_bytes, float(now))
        self._sync()
        return self._actions(raw)

    def disk_writes(
        self, node: NodeId, unwritten: list[ShardId], failures: int, writable: bool
    ) -> list[ShardId]:
        """As :meth:`ChunkIndex.disk_writes`."""
        self.stats.disk_write_failures += failures
        forgotten: list[ShardId] = self._core.disk_writes(node, list(unwritten), writable)
        self._sync()
        return forgotten

    def restore(
        self,
        node: NodeId,
        held: list[tuple[ShardOffer, TierName]],
        now: float = 0.0,
        grace_s: float = 0.0,
    ) -> tuple[list[bool], Actions]:
        """As :meth:`ChunkIndex.restore`."""
        if node not in self._registered:
            if not held:
                return [], {}
            raise KeyError(node)  # as the reference: restore follows register_node
        accepted, raw = self._core.restore(
            node, list(held), float(now), float(grace_s), _RESTORE_GRACE_HOLDER
        )
        self._sync()
        return accepted, self._actions(raw)

    def forget_node(self, node: NodeId) -> Actions:
        """As :meth:`ChunkIndex.forget_node` (its drops in another order: the reference's
        follows a set's). Units are rescued by replicas in the same (UnitId) order; only
        those with a replica are sorted, the others cannot be rescued."""
        raw = self._core.forget_node(node)
        self._registered.discard(node)
        self._sync()
        return self._actions(raw)

    def nodes(self) -> dict[NodeId, dict[TierName, tuple[int, int, int]]]:
        """node -> tier -> (used bytes, capacity bytes, shards)."""
        nodes: dict[NodeId, dict[TierName, tuple[int, int, int]]] = self._core.nodes()
        return nodes

    def node(self, node: NodeId) -> dict[TierName, tuple[int, int, int]] | None:
        """As :meth:`ChunkIndex.node`."""
        tiers: dict[TierName, tuple[int, int, int]] | None = self._core.node(node)
        return tiers

    # ---- stores ----------------------------------------------------------------------
    def admit(self, node: NodeId, offers: list[ShardOffer], now: float) -> AdmitResult:
        """As :meth:`ChunkIndex.admit`."""
        self._known(node)
        accepted, raw, invalid = self._core.admit(node, list(offers), None, float(now))
        self._sync()
        if invalid:
            logger.warning("refused %d shard(s) whose rank is outside their world", invalid)
        return AdmitResult(accepted, self._actions(raw))

    def admit_units(self, node: NodeId, units: list[UnitOffer], now: float) -> UnitAdmitResult:
        """As :meth:`ChunkIndex.admit_units`: one decision per unit offer."""
        self._known(node)
        sizes = [len(unit.shards) for unit in units]
        offers = [offer for unit in units for offer in unit.shards]
        flat, raw, invalid = self._core.admit(node, offers, sizes, float(now))
        self._sync()
        if invalid:
            logger.warning("refused %d shard(s) whose rank is outside their world", invalid)
        flags = iter(flat)
        accepted = [list(islice(flags, size)) for size in sizes]
        return UnitAdmitResult(accepted, self._actions(raw))

    # ---- lookups, leases and promotion -----------------------------------------------
    def lookup(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        holder: str,
        now: float,
        lease_ttl_s: float,
        node: NodeId | None = None,
    ) -> tuple[list[LookupAnswer], Actions]:
        """As :meth:`ChunkIndex.lookup`: a HIT names ``node`` when its replica is complete."""
        answers, raw = self._core.lookup(
            namespace, list(keys), holder, float(now), float(lease_ttl_s), node
        )
        self._sync()
        return answers, self._actions(raw)

    def extend_leases(
        self, namespace: Namespace, keys: list[ChunkKey], holder: str, now: float, ttl_s: float
    ) -> None:
        self._core.extend_leases(namespace, list(keys), holder, float(now), float(ttl_s))

    def release(self, namespace: Namespace, keys: list[ChunkKey], holder: str) -> None:
        self._core.release(namespace, list(keys), holder)

    def release_holder(self, holder: str) -> None:
        """An engine went away: everything it held is evictable again."""
        self._core.release_holder(holder)

    def is_leased(self, namespace: Namespace, key: ChunkKey, now: float) -> bool:
        leased: bool = self._core.is_leased(namespace, key, float(now))
        return leased

    def promoted(
        self, node: NodeId, done: list[ShardId], failed: list[ShardId], refused: list[ShardId]
    ) -> Actions:
        """As :meth:`ChunkIndex.promoted`."""
        self._core.promoted(list(done), list(refused))
        self._sync()
        self.stats.corrupt_before_hit += len(failed)
        return self.forget_shards(failed)

    def report_corrupt_after_hit(self, shard_ids: list[ShardId]) -> Actions:
        self.stats.corrupt_after_hit += len(shard_ids)
        return self.forget_shards(shard_ids)

    def forget_shards(self, shard_ids: list[ShardId]) -> Actions:
        """Shards that turned out missing or bad: their units are gone everywhere."""
        raw = self._core.forget_shards(list(shard_ids))
        self._sync()
        return self._actions(raw)

    # ---- replicas -------------------------------------------------------------------
    def record_loads(self, namespace: Namespace, keys: list[ChunkKey], node: NodeId) -> Actions:
        """As :meth:`ChunkIndex.record_loads`: a chunk ``node`` loaded from elsewhere
        ``replicate_after_loads`` times is copied into its CPU tier if that fits below the
        low watermark (a replica never evicts anything)."""
        if not self._replicate_after:
            return {}
        return self._copies(namespace, keys, node, lambda cid: self._remote_loads.due(cid, node))

    def start_copies(self, namespace: Namespace, keys: list[ChunkKey], node: NodeId) -> Actions:
        """As :meth:`ChunkIndex.start_copies`: copies on ``node`` of the complete chunks
        it holds no shard of, started now (no count of loads); the holders' pushes."""
        return self._copies(namespace, keys, node, None)

    def _copies(
        self,
        namespace: Namespace,
        keys: list[ChunkKey],
        node: NodeId,
        due: Callable[[ChunkId], bool] | None,
    ) -> Actions:
        """Copies on ``node`` of the candidates among ``keys`` (and, given ``due``, that
        are due: asked only of candidates), started now; the holders' pushes."""
        if node not in self._registered:
            return {}
        merged: Actions = {}
        started: set[ChunkKey] = set()  # a replica made in this call: its node holds it now
        counts = self._core.replica_candidates(namespace, list(keys), node)
        for key, candidate in zip(keys, counts, strict=True):
            if not candidate or key in started:
                continue
            if due is not None and not due(ChunkId(namespace, key)):
                continue
            made, raw = self._core.start_replica(namespace, key, node)
            if made:
                started.add(key)
            for holder, actions in self._actions(raw).items():
                merged.setdefault(holder, NodeActions()).push.extend(actions.push)
        return merged

    def replicated(self, node: NodeId, done: list[ShardId], failed: list[ShardId]) -> Actions:
        """As :meth:`ChunkIndex.replicated`: ``node``'s replica shards landed, or could not
        (its replica is dropped); one whose chunk or replica went meanwhile is dropped."""
        raw = self._core.replicated(node, list(done), list(failed))
        self._sync()
        return self._actions(raw)

    def locate(
        self, namespace: Namespace, keys: list[ChunkKey], rank: int, avoid: NodeId
    ) -> list[NodeId | None]:
        """Per key, a node other than ``avoid`` holding ``rank``'s shard: the holder, else
        a complete replica."""
        found: list[NodeId | None] = self._core.locate(namespace, list(keys), rank, avoid)
        return found

    def replicas_on(self, node: NodeId) -> set[ChunkId]:
        """Chunks with a complete replica on ``node``."""
        return {ChunkId(ns, key) for ns, key in self._core.replicas_on(node)}

    # ---- introspection ---------------------------------------------------------------
    def record_loaded(self, n_chunks: int) -> None:
        self.stats.loaded_chunks += n_chunks

    def record_failed_stores(self, n_jobs: int) -> None:
        self.stats.failed_stores += n_jobs

    def shards_on(self, node: NodeId) -> set[tuple[ShardId, TierName]]:
        """Every copy the index believes ``node`` holds (replicas once complete)."""
        return set(self._core.shards_on(node))

    def units(self) -> dict[UnitId, tuple[set[UnitId], set[UnitId]]]:
        """unit -> (parents, children), for tests and status."""
        units: dict[UnitId, tuple[set[UnitId], set[UnitId]]] = self._core.units()
        return units

    def holders(self) -> int:
        """Lease holders the index keeps an id for: those with a lease (an expired one
        counts until the index next looks at it, as ChunkIndex keeps it)."""
        count: int = self._core.holders()
        return count

    def memory_bytes(self) -> int:
        """Bytes the core's arrays hold (their capacity, not only what is used)."""
        nbytes: int = self._core.memory_bytes()
        return nbytes

    def __len__(self) -> int:
        size: int = self._core.size()
        return size

    def __contains__(self, cid: object) -> bool:
        if not isinstance(cid, tuple) or len(cid) != 2:
            return False
        namespace, key = cid
        return isinstance(key, bytes) and bool(self._core.contains(namespace, key))


def make_index(
    policy: str = "lru", watermarks: Watermarks | None = None, replicate_after_loads: int = 0
) -> ChunkIndex | CompactChunkIndex:
    """The compact index where it is built and supports the settings (the LRU policy),
    else ChunkIndex (the same decisions, at the reference's speed and memory), saying why."""
    if not available():
        logger.warning("compact index not built (no C compiler at install): using ChunkIndex")
    elif policy != "lru":
        logger.info("compact index supports the lru policy only, not %r: using ChunkIndex", policy)
    else:
        return CompactChunkIndex(policy, watermarks, replicate_after_loads)
    return ChunkIndex(policy, watermarks, replicate_after_loads)
