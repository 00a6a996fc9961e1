"""A NodeStore offers the Evictor units, not shards (issue 28): a TP group's ranks
committing the same chunks through the arena, each in its own call, are one admission
per token boundary at the Evictor (every rank's and KV cache group's shard); through the
object store (no gathering) a call's groups are one decision, and ranks stored in
separate calls complete the chunk (a MISS until the last rank is held). Nothing lost:
every rank loads its own bytes.

Real Ray: the real Evictor and the node's real NodeStore, through its client; the two
ranks are two holders of the node's arena in this process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
from tierstore.actors.bootstrap import find_node_store, get_or_create_evictor
from tierstore.actors.clients import EvictorClient, NodeStoreClient

from tests.support import poll, wait_for
from tierstore.config import TierStoreConfig
from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.region import ArenaMapping
from tierstore.data.checksum import digest
from tierstore.keys import ChunkKey, Namespace, ShardId
from tierstore.wire import LookupState, ShardEntry

NS = Namespace("a7u1")
GROUPS = 3
BOUNDARIES = 4
SHARD = 256


def _key(boundary: int, group: int) -> ChunkKey:
    return ChunkKey((boundary + 1).to_bytes(8, "big") + group.to_bytes(4, "big"))


def _job(rank: int) -> tuple[list[ShardEntry], np.ndarray]:
    """One rank's store of a request: every group's chunk at each boundary, chained."""
    keys = [(b, g) for b in range(BOUNDARIES) for g in range(GROUPS)]
    buffer = np.random.default_rng(rank).integers(0, 256, SHARD * len(keys), dtype=np.uint8)
    entries = []
    for i, (b, g) in enumerate(keys):
        data = buffer[i * SHARD : (i + 1) * SHARD]
        parent = _key(b - 1, g) if b else None
        entries.append(ShardEntry(_key(b, g), i * SHARD, SHARD, digest(data), 1, parent))
    return entries, buffer


def _totals(evictor: Any) -> dict[str, int]:
    return ray.get(evictor.status.remote(), timeout=10)["totals"]


def test_a_stores_groups_are_one_decision_and_ranks_complete_the_chunk(
    cfg: TierStoreConfig,
) -> None:
    handle, store, _ = _evictor_and_store(cfg)
    evictor = EvictorClient(handle)
    keys = [_key(b, g) for b in range(BOUNDARIES) for g in range(GROUPS)]
    before = _totals(handle)

    entries, buffer = _job(0)
    assert store.store(NS, 0, 2, entries, buffer).result() == len(keys)
    after_first = _totals(handle)
    assert after_first["admit_calls"] - before["admit_calls"] == 1
    assert after_first["admitted_units"] - before["admitted_units"] == BOUNDARIES
    answers = evictor.lookup(NS, keys, "t", 30.0).result()
    assert {a.state for a in answers} == {LookupState.MISS}  # rank 1 not held yet

    entries, buffer = _job(1)
    assert store.store(NS, 1, 2, entries, buffer).result() == len(keys)
    after = _totals(handle)
    assert after["admitted_units"] - after_first["admitted_units"] == BOUNDARIES
    answers = evictor.lookup(NS, keys, "t", 30.0).result()
    assert [a.state for a in answers] == [LookupState.HIT] * len(keys)
    assert all(set(a.where or {}) == {0, 1} for a in answers)
    for rank in (0, 1):  # every rank's bytes, as stored
        views, _ = store.load(NS, rank, keys).result()
        assert b"".join(bytes(v) for v in views) == bytes(_job(rank)[1])


def _evictor_and_store(cfg: TierStoreConfig) -> tuple[Any, NodeStoreClient, str]:
    handle = get_or_create_evictor(cfg)
    node = ray.get_runtime_context().get_node_id()
    wait_for(
        lambda: node in ray.get(handle.status.remote(), timeout=10)["nodes"],
        "this node registered with the Evictor",
        timeout_s=60,
    )
    return handle, NodeStoreClient(find_node_store(cfg.namespace, node), node), node


def _arena_commit(
    store: NodeStoreClient, mapping: ArenaMapping, lock: HolderLock, rank: int
) -> None:
    """Rank ``rank``'s store of the request, as its worker commits it: its bytes written
    into extents granted to it, then one commit call."""
    entries, buffer = _job(rank)
    region, _ = store.arena_info().result()
    assert region is not None
    epoch, offsets = store.arena_grant(lock.holder, region.epoch, [SHARD] * len(entries)).result()
    placed = []
    for entry, offset in zip(entries, offsets, strict=True):
        assert offset is not None
        mapping.view(offset, SHARD)[:] = buffer[entry.offset : entry.offset + SHARD]
        placed.append(entry._replace(offset=offset))
    store.arena_commit(lock.holder, epoch, NS, rank, 2, [placed]).result()


def test_two_ranks_arena_commits_of_the_same_chunks_are_one_admit_per_boundary(
    cfg: TierStoreConfig,
) -> None:
    handle, store, _ = _evictor_and_store(cfg)
    evictor = EvictorClient(handle)
    region, _ = store.arena_info().result()
    assert region is not None
    mapping = ArenaMapping(region)
    ranks = [HolderLock(region.path) for _ in range(2)]
    keys = [_key(b, g) for b in range(BOUNDARIES) for g in range(GROUPS)]
    before = _totals(handle)
    try:
        for rank, lock in enumerate(ranks):  # each rank's commit: its own call
            _arena_commit(store, mapping, lock, rank)
        after = _totals(handle)
        assert after["admit_calls"] - before["admit_calls"] == 1  # once both ranks were in
        assert after["admitted_units"] - before["admitted_units"] == BOUNDARIES
        answers = evictor.lookup(NS, keys, "t", 30.0).result()
        assert [a.state for a in answers] == [LookupState.HIT] * len(keys)
        for rank in (0, 1):
            views, _ = store.load(NS, rank, keys).result()
            assert b"".join(bytes(v) for v in views) == bytes(_job(rank)[1])
    finally:
        for lock in ranks:
            lock.close()
        mapping.close()


def test_a_rank_that_never_commits_leaves_a_partial_unit_indexed_not_parked(
    cfg: TierStoreConfig,
) -> None:
    """Rank 1 never commits, and no other commit comes: the NodeStore's flusher offers
    rank 0's gathered shards all the same (MISSes until a rank 1 would complete them)."""
    handle, store, node = _evictor_and_store(cfg)
    region, _ = store.arena_info().result()
    assert region is not None
    mapping = ArenaMapping(region)
    lock = HolderLock(region.path)
    keys = [_key(b, g) for b in range(BOUNDARIES) for g in range(GROUPS)]
    try:
        _arena_commit(store, mapping, lock, 0)
        indexed = poll(lambda: ray.get(handle.index_view.remote(node), timeout=10), 20)
        assert {ShardId(*s).key for s, _ in indexed} == set(keys)
        assert store.status().result()["gathered_shards"] == 0
        answers = EvictorClient(handle).lookup(NS, keys, "t", 30.0).result()
        assert {a.state for a in answers} == {LookupState.MISS}
        views, _ = store.load(NS, 0, keys).result()
        assert b"".join(bytes(v) for v in views) == bytes(_job(0)[1])
    finally:
        lock.close()
        mapping.close()
