"""The Evictor's logic: LRU, capacity accounting per node, leases, whole-chunk eviction."""

from __future__ import annotations

from tierstore.control.index import ChunkIndex, ShardOffer
from tierstore.control.policies import POLICIES
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId

NS = Namespace("ns")
A, B = NodeId("node-a"), NodeId("node-b")


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + (0).to_bytes(4, "big"))


def offer(i: int, nbytes: int = 100, rank: int = 0, world: int = 1) -> ShardOffer:
    return ShardOffer(NS, key(i), rank, world, nbytes)


def test_every_registered_policy_imports() -> None:
    for name in POLICIES.names():
        assert POLICIES.get(name)() is not None


def test_admit_until_full_then_evict_least_recently_used() -> None:
    index = ChunkIndex()
    index.register_node(A, 300)
    for i in range(3):
        assert index.admit(A, [offer(i)], now=0).accepted == [True]
    index.lookup(NS, [key(0)], "h", now=0, lease_ttl_s=1)  # 0 becomes most recent
    index.release(NS, [key(0)], "h")
    result = index.admit(A, [offer(3)], now=0)
    assert result.accepted == [True]
    assert result.drops == {A: [ShardId(NS, key(1), 0)]}
    assert index.nodes()[A] == (300, 300, 3)
    assert index.stats.evicted_chunks == 1


def test_capacity_is_never_exceeded_and_oversized_shards_are_skipped() -> None:
    index = ChunkIndex()
    index.register_node(A, 250)
    assert index.admit(A, [offer(0, 400)], now=0).accepted == [False]
    assert index.admit(A, [offer(1), offer(2), offer(3)], now=0).accepted == [True, True, False]
    assert index.nodes()[A][0] <= 250
    assert index.stats.skipped_stores == 2


def test_hit_under_lease_is_not_evicted_until_the_lease_ends() -> None:
    index = ChunkIndex()
    index.register_node(A, 200)
    index.admit(A, [offer(0), offer(1)], now=0)
    assert index.lookup(NS, [key(0), key(1)], "engine/r1", now=0, lease_ttl_s=10) == [
        {0: A},
        {0: A},
    ]
    # Both leased: a new store is skipped rather than evicting a HIT.
    assert index.admit(A, [offer(2)], now=5).accepted == [False]
    # After the lease expires (a crashed engine), the chunks are evictable again.
    assert index.admit(A, [offer(2)], now=11).accepted == [True]


def test_released_lease_makes_chunk_evictable() -> None:
    index = ChunkIndex()
    index.register_node(A, 100)
    index.admit(A, [offer(0)], now=0)
    index.lookup(NS, [key(0)], "h", now=0, lease_ttl_s=100)
    assert index.admit(A, [offer(1)], now=1).accepted == [False]
    index.release(NS, [key(0)], "h")
    assert index.admit(A, [offer(1)], now=1).accepted == [True]


def test_chunk_is_a_hit_only_when_every_rank_is_stored() -> None:
    index = ChunkIndex()
    index.register_node(A, 1000)
    index.register_node(B, 1000)
    index.admit(A, [offer(0, rank=0, world=2)], now=0)
    assert index.lookup(NS, [key(0)], "h", now=0, lease_ttl_s=1) == [None]
    index.admit(B, [offer(0, rank=1, world=2)], now=0)
    assert index.lookup(NS, [key(0)], "h", now=0, lease_ttl_s=1) == [{0: A, 1: B}]
    assert index.stats.hits == 1 and index.stats.misses == 1


def test_evicting_a_chunk_drops_every_rank_everywhere() -> None:
    index = ChunkIndex()
    index.register_node(A, 100)
    index.register_node(B, 1000)
    index.admit(A, [offer(0, rank=0, world=2)], now=0)
    index.admit(B, [offer(0, rank=1, world=2)], now=0)
    result = index.admit(A, [offer(1, rank=0, world=2)], now=0)
    assert result.drops == {A: [ShardId(NS, key(0), 0)], B: [ShardId(NS, key(0), 1)]}
    assert index.nodes()[B] == (0, 1000, 0)


def test_duplicate_shard_is_refused_without_double_counting() -> None:
    index = ChunkIndex()
    index.register_node(A, 1000)
    index.admit(A, [offer(0)], now=0)
    assert index.admit(A, [offer(0)], now=0).accepted == [False]
    assert index.nodes()[A] == (100, 1000, 1)


def test_forgetting_a_node_drops_its_chunks_elsewhere() -> None:
    index = ChunkIndex()
    index.register_node(A, 1000)
    index.register_node(B, 1000)
    index.admit(A, [offer(0, rank=0, world=2)], now=0)
    index.admit(B, [offer(0, rank=1, world=2)], now=0)
    assert index.forget_node(A) == {B: [ShardId(NS, key(0), 1)]}
    assert index.lookup(NS, [key(0)], "h", now=0, lease_ttl_s=1) == [None]
    assert A not in index.nodes()
