"""An Evictor shard's share of a node resized (resize_node): it evicts down to the new
share as a store makes room (demoting to disk before dropping), keeps what a store
could not evict, and the compact index decides as the reference (no Ray)."""

from __future__ import annotations

import random

import pytest

from tests.control.test_compact_index import NODES, WIDE, Pair, Workload, cpu_bytes, play
from tierstore.control import compact_index
from tierstore.control.compact_index import CompactChunkIndex
from tierstore.control.index import ChunkIndex, ShardOffer, Watermarks
from tierstore.errors import UnknownNodeError
from tierstore.keys import ChunkKey, Namespace, NodeId, TierName

NS = Namespace("resize")
NODE = NodeId("n0")
SHARD = 10


def _indexes() -> list[ChunkIndex | CompactChunkIndex]:
    found: list[ChunkIndex | CompactChunkIndex] = [ChunkIndex()]
    if compact_index.available():
        found.append(CompactChunkIndex())
    return found


def _store_chains(index: ChunkIndex | CompactChunkIndex, chains: int, length: int) -> None:
    for c in range(chains):
        parent = None
        for i in range(length):
            key = ChunkKey(bytes([c, i]) * 4)
            offer = ShardOffer(NS, key, 0, 1, SHARD, parent)
            assert index.admit(NODE, [offer], float(c)).accepted == [True]
            parent = key


def _held(index: ChunkIndex | CompactChunkIndex, tier: TierName) -> int:
    return index.nodes()[NODE][tier][0]


@pytest.mark.parametrize("index", _indexes(), ids=type)
def test_a_smaller_cpu_share_demotes_to_disk_and_drops_nothing(
    index: ChunkIndex | CompactChunkIndex,
) -> None:
    index.register_node(NODE, 100, 1000)
    _store_chains(index, 3, 3)  # 90 bytes in memory
    before = len(index)
    actions = index.resize_node(NODE, 40, 1000, 10.0)
    assert _held(index, TierName.CPU) <= 40
    assert actions[NODE].drop == []
    assert len(actions[NODE].demote) == 90 // SHARD - _held(index, TierName.CPU) // SHARD
    assert len(index) == before  # every chunk still indexed, now on disk
    assert index.nodes()[NODE][TierName.CPU][1] == 40


@pytest.mark.parametrize("index", _indexes(), ids=type)
def test_a_smaller_disk_share_drops_disk_only_tails_and_a_larger_one_evicts_nothing(
    index: ChunkIndex | CompactChunkIndex,
) -> None:
    index.register_node(NODE, 40, 1000)
    _store_chains(index, 3, 3)  # write-through: 90 bytes on disk, 40 of them also in memory
    assert index.resize_node(NODE, 80, 1000, 10.0) == {}
    actions = index.resize_node(NODE, 40, 50, 10.0)
    assert _held(index, TierName.DISK) <= 50
    assert actions[NODE].drop and actions[NODE].demote == []


@pytest.mark.parametrize("index", _indexes(), ids=type)
def test_leased_chunks_stay_above_the_new_share(index: ChunkIndex | CompactChunkIndex) -> None:
    index.register_node(NODE, 100, 0)  # no disk: room is made by dropping tails
    _store_chains(index, 1, 5)
    keys = [ChunkKey(bytes([0, i]) * 4) for i in range(5)]
    index.lookup(NS, keys, "engine", 10.0, 30.0)
    index.resize_node(NODE, 20, 0, 11.0)
    assert _held(index, TierName.CPU) == 50  # all leased: nothing evicted
    index.release(NS, keys, "engine")
    index.resize_node(NODE, 20, 0, 12.0)
    assert _held(index, TierName.CPU) <= 20


@pytest.mark.parametrize("index", _indexes(), ids=type)
def test_a_node_not_registered_is_refused(index: ChunkIndex | CompactChunkIndex) -> None:
    with pytest.raises(UnknownNodeError):
        index.resize_node(NODE, 1, 1, 0.0)


@pytest.mark.skipif(not compact_index.available(), reason="the compact index is not built")
@pytest.mark.parametrize("seed", range(6))
def test_resizes_amid_random_workloads_decide_as_the_reference(seed: int) -> None:
    """Shares shrunk and grown between random workloads: both indexes return the same
    actions and end in the same state (tests/control/test_compact_index.py's play)."""
    rng = random.Random(seed)
    disk_bytes = [0, 300, 1000][seed % 3]
    pair = Pair(disk_bytes, [Watermarks(0.9, 0.7), Watermarks()][seed % 2], seed % 3)
    load = Workload(1 + seed % 2, [12, 36, 68][seed % 3])
    names = ["store", "store_units", "lookup", "release", "promoted", "tick", "disk_writes"]
    for _ in range(40):
        ops = []
        for _ in range(25):
            op = rng.choice(names)
            a = rng.choice([rng.randrange(16), WIDE + rng.randrange(8)])
            if op in ("promoted", "tick"):
                a = rng.randrange(1, 20) if op == "tick" else rng.randrange(3)
            c = rng.randrange(4) if op == "disk_writes" else rng.randrange(5, 45)
            ops.append((op, a, rng.randrange(6), c))
        play(pair, load, ops, disk_bytes)
        node = rng.choice(NODES)
        cpu = rng.randrange(0, 2 * cpu_bytes(node))
        disk = rng.randrange(0, 2 * disk_bytes + 1)
        pair.call("resize_node", node, cpu, disk, float(rng.randrange(0, 400)))
        pair.same_state([])
    assert pair.ref.stats.demoted_shards or not disk_bytes
    assert pair.ref.stats.evicted_chunks


@pytest.mark.parametrize("index", _indexes(), ids=type)
def test_one_nodes_entry_is_its_entry_of_nodes(index: ChunkIndex | CompactChunkIndex) -> None:
    assert index.node(NODE) is None
    index.register_node(NODE, 100, 50)
    index.register_node(NodeId("n1"), 7, 0)
    _store_chains(index, 1, 2)
    assert index.node(NODE) == index.nodes()[NODE]
    assert index.node(NodeId("n1")) == {TierName.CPU: (0, 7, 0), TierName.DISK: (0, 0, 0)}
