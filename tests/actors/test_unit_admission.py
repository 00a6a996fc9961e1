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

from tests.support import wait_for
from tierstore.config import TierStoreConfig
from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.region import ArenaMapping
from tierstore.data.checksum import digest
from tierstore.keys import ChunkKey, Namespace
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
    handle = get_or_create_evictor(cfg)
    node = ray.get_runtime_context().get_node_id()
    wait_for(
        lambda: node in ray.get(handle.status.remote(), timeout=10)["nodes"],
        "this node registered with the Evictor",
        timeout_s=60,
    )
    store = NodeStoreClient(find_node_store(cfg.namespace, node), node)
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


def test_two_ranks_arena_commits_of_the_same_chunks_are_one_admit_per_boundary(
    cfg: TierStoreConfig,
) -> None:
    handle = get_or_create_evictor(cfg)
    node = ray.get_runtime_context().get_node_id()
    wait_for(
        lambda: node in ray.get(handle.status.remote(), timeout=10)["nodes"],
        "this node registered with the Evictor",
        timeout_s=60,
    )
    store = NodeStoreClient(find_node_store(cfg.namespace, node), node)
    evictor = EvictorClient(handle)
    region, _ = store.arena_info().result()
    assert region is not None
    mapping = ArenaMapping(region)
    ranks = [HolderLock(region.path) for _ in range(2)]
    keys = [_key(b, g) for b in range(BOUNDARIES) for g in range(GROUPS)]
    before = _totals(handle)
    try:
        for rank, lock in enumerate(ranks):  # each rank's commit: its own call
            entries, buffer = _job(rank)
            epoch, offsets = store.arena_grant(
                lock.holder, region.epoch, [SHARD] * len(keys)
            ).result()
            assert epoch == region.epoch and None not in offsets
            placed = []
            for entry, offset in zip(entries, offsets, strict=True):
                assert offset is not None
                mapping.view(offset, SHARD)[:] = buffer[entry.offset : entry.offset + SHARD]
                placed.append(entry._replace(offset=offset))
            store.arena_commit(lock.holder, epoch, NS, rank, 2, [placed]).result()
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
