"""The Evictor's logic: capacity per node and tier, leases, tail-first eviction, promotion."""

from __future__ import annotations

from tierstore.control.index import ChunkIndex, LookupState, NodeActions, ShardOffer, Watermarks
from tierstore.control.policies import POLICIES
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName

NS = Namespace("ab")
A, B = NodeId("node-a"), NodeId("node-b")
CPU, DISK = TierName.CPU, TierName.DISK


def key(i: int, group: int = 0) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + group.to_bytes(4, "big"))


def offer(
    i: int,
    nbytes: int = 100,
    rank: int = 0,
    world: int = 1,
    parent: int | None = None,
    group: int = 0,
) -> ShardOffer:
    return ShardOffer(
        NS, key(i, group), rank, world, nbytes, key(parent, group) if parent is not None else None
    )


def sid(i: int, rank: int = 0, group: int = 0) -> ShardId:
    return ShardId(NS, key(i, group), rank)


def hit(index: ChunkIndex, i: int, now: float = 0, holder: str = "h", ttl: float = 1):
    (answer,), actions = index.lookup(NS, [key(i)], holder, now, ttl)
    return answer, actions


def test_every_registered_policy_imports() -> None:
    for name in POLICIES.names():
        assert POLICIES.get(name)() is not None


def test_without_disk_full_cpu_evicts_least_recently_used() -> None:
    index = ChunkIndex()
    index.register_node(A, 300)
    for i in range(3):
        assert index.admit(A, [offer(i)], now=0).accepted == [True]
    hit(index, 0)  # 0 becomes most recent
    index.release(NS, [key(0)], "h")
    result = index.admit(A, [offer(3)], now=0)
    assert result.accepted == [True]
    assert result.actions[A].drop == [sid(1)]
    assert index.nodes()[A][CPU] == (300, 300, 3)
    assert index.stats.evicted_chunks == 1


def test_capacity_is_never_exceeded_and_oversized_shards_are_skipped() -> None:
    index = ChunkIndex()
    index.register_node(A, 250)
    assert index.admit(A, [offer(0, 400)], now=0).accepted == [False]
    assert index.admit(A, [offer(1), offer(2), offer(3)], now=0).accepted == [True, True, False]
    assert index.nodes()[A][CPU][0] <= 250
    assert index.stats.skipped_stores == 2


def test_hit_under_lease_is_not_evicted_until_the_lease_ends() -> None:
    index = ChunkIndex()
    index.register_node(A, 200)
    index.admit(A, [offer(0), offer(1)], now=0)
    answers, _ = index.lookup(NS, [key(0), key(1)], "engine/r1", 0, 10)
    assert [a.state for a in answers] == [LookupState.HIT, LookupState.HIT]
    assert answers[0].where == {0: A}
    # Both leased: a new store is skipped rather than evicting a HIT.
    assert index.admit(A, [offer(2)], now=5).accepted == [False]
    # After the lease expires (a crashed engine), the chunks are evictable again.
    assert index.admit(A, [offer(2)], now=11).accepted == [True]


def test_released_lease_makes_chunk_evictable() -> None:
    index = ChunkIndex()
    index.register_node(A, 100)
    index.admit(A, [offer(0)], now=0)
    hit(index, 0, ttl=100)
    assert index.admit(A, [offer(1)], now=1).accepted == [False]
    index.release(NS, [key(0)], "h")
    assert index.admit(A, [offer(1)], now=1).accepted == [True]


def test_chunk_is_a_hit_only_when_every_rank_is_stored() -> None:
    index = ChunkIndex()
    index.register_node(A, 1000)
    index.register_node(B, 1000)
    index.admit(A, [offer(0, rank=0, world=2)], now=0)
    assert hit(index, 0)[0].state is LookupState.MISS
    index.admit(B, [offer(0, rank=1, world=2)], now=0)
    answer, _ = hit(index, 0)
    assert answer.state is LookupState.HIT and answer.where == {0: A, 1: B}
    assert index.stats.hits == 1 and index.stats.misses == 1


def test_dropping_a_chunk_drops_every_rank_everywhere() -> None:
    index = ChunkIndex()
    index.register_node(A, 100)
    index.register_node(B, 1000)
    index.admit(A, [offer(0, rank=0, world=2)], now=0)
    index.admit(B, [offer(0, rank=1, world=2)], now=0)
    result = index.admit(A, [offer(1, rank=0, world=2)], now=0)
    assert result.actions[A].drop == [sid(0, 0)]
    assert result.actions[B].drop == [sid(0, 1)]
    assert index.nodes()[B][CPU] == (0, 1000, 0)


def test_duplicate_shard_is_refused_without_double_counting() -> None:
    index = ChunkIndex()
    index.register_node(A, 1000)
    index.admit(A, [offer(0)], now=0)
    assert index.admit(A, [offer(0)], now=0).accepted == [False]
    assert index.nodes()[A][CPU] == (100, 1000, 1)


def test_forgetting_a_node_drops_its_chunks_elsewhere() -> None:
    index = ChunkIndex()
    index.register_node(A, 1000)
    index.register_node(B, 1000)
    index.admit(A, [offer(0, rank=0, world=2)], now=0)
    index.admit(B, [offer(0, rank=1, world=2)], now=0)
    assert index.forget_node(A) == {B: NodeActions(drop=[sid(0, 1)])}
    assert hit(index, 0)[0].state is LookupState.MISS
    assert A not in index.nodes()


def test_stores_are_written_through_and_a_full_cpu_frees_its_tails_first() -> None:
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    index.register_node(A, 200, 200)
    first = index.admit(A, [offer(0), offer(1, parent=0)], now=0)  # a chain 0 <- 1
    assert first.actions[A].persist == [sid(0), sid(1)]
    assert index.nodes()[A] == {CPU: (200, 200, 2), DISK: (200, 200, 2)}
    result = index.admit(A, [offer(2)], now=0)
    # The chain's tail leaves memory first (free: it is on disk), and the oldest
    # disk-only tail makes room for the new shard's disk copy.
    assert result.actions[A].demote == [sid(1)]
    assert result.actions[A].drop == [sid(1)]
    assert result.actions[A].persist == [sid(2)]
    assert index.shards_on(A) == {(sid(0), CPU), (sid(0), DISK), (sid(2), CPU), (sid(2), DISK)}


def test_without_room_on_disk_a_store_stays_in_memory_only() -> None:
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    index.register_node(A, 300, 100)
    index.admit(A, [offer(0)], now=0)
    hit(index, 0, ttl=100)  # leased: its disk copy cannot be dropped for room
    result = index.admit(A, [offer(1)], now=1)
    assert result.accepted == [True] and A not in result.actions
    assert index.shards_on(A) == {(sid(0), CPU), (sid(0), DISK), (sid(1), CPU)}


def test_a_chain_head_is_never_dropped_before_its_tail() -> None:
    index = ChunkIndex()
    index.register_node(A, 300)
    index.admit(A, [offer(0), offer(1, parent=0), offer(2, parent=1)], now=0)
    hit(index, 2)  # the tail is the most recent, the head the least
    index.release(NS, [key(2)], "h")
    result = index.admit(A, [offer(9)], now=0)
    assert result.actions[A].drop == [sid(2)]  # LRU would have taken 0


def test_every_group_at_a_boundary_goes_together() -> None:
    index = ChunkIndex()
    index.register_node(A, 400)
    index.admit(A, [offer(0, group=0), offer(0, group=1), offer(1, group=0), offer(1, group=1)], 0)
    result = index.admit(A, [offer(5)], now=0)
    assert sorted(result.actions[A].drop) == sorted([sid(0, group=0), sid(0, group=1)])


def test_a_disk_chunk_written_since_start_up_is_a_hit_at_once_and_promoted_meanwhile() -> None:
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    index.register_node(A, 100, 1000)
    index.admit(A, [offer(0)], now=0)
    index.admit(A, [offer(1)], now=0)  # demotes 0 (its written-through copy stays)
    answer, actions = hit(index, 0)
    assert (answer.state, answer.tier, answer.where) == (LookupState.HIT, DISK, {0: A})
    assert actions[A].promote == [sid(0)] and actions[A].demote == [sid(1)]
    # Promotion under way: still a HIT whose bytes may come from disk; nothing sent twice.
    answer, actions = hit(index, 0)
    assert (answer.state, answer.tier) == (LookupState.HIT, DISK) and not actions
    index.promoted(A, [sid(0)], [], [])
    answer, _ = hit(index, 0)
    assert (answer.state, answer.tier) == (LookupState.HIT, CPU)
    assert index.stats.promoted_shards == 1 and index.stats.disk_hits == 2


def test_a_disk_chunk_found_at_start_up_is_verified_by_its_promotion_before_a_hit() -> None:
    """A file may have been damaged while the node was down: until a read has checked it,
    its chunk is PENDING, so a corrupt one is a clean miss rather than a failed load."""
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    index.register_node(A, 300, 10_000)
    index.restore(A, [(offer(0), DISK), (offer(1), DISK)])
    answer, actions = hit(index, 0)
    assert answer.state is LookupState.PENDING and actions[A].promote == [sid(0)]
    assert hit(index, 0)[0].state is LookupState.PENDING
    index.promoted(A, [sid(0)], [], [])
    answer, _ = hit(index, 0)
    assert (answer.state, answer.tier) == (LookupState.HIT, CPU)
    # Verified on its way to memory: demoted again, its disk copy is a HIT at once.
    index.release(NS, [key(0)], "h")
    for i in (2, 3, 4):  # the third demotes 0, the least recently used
        assert index.admit(A, [offer(i)], now=0).accepted == [True]
    assert (sid(0), CPU) not in index.shards_on(A)
    answer, _ = hit(index, 0)
    assert (answer.state, answer.tier) == (LookupState.HIT, DISK)
    # The other restored chunk, never read: still verified first.
    assert hit(index, 1)[0].state is LookupState.PENDING


def test_corrupt_promotion_becomes_a_miss_and_is_counted() -> None:
    index = ChunkIndex()
    index.register_node(A, 100, 1000)
    index.restore(A, [(offer(0), DISK)])
    assert hit(index, 0)[0].state is LookupState.PENDING
    index.promoted(A, [], [sid(0)], [])
    assert hit(index, 0)[0].state is LookupState.MISS
    assert index.stats.corrupt_before_hit == 1
    assert sid(0) not in {s for s, _ in index.shards_on(A)}


def test_a_promotion_the_node_refuses_keeps_its_disk_copy_as_a_disk_hit() -> None:
    """The node's CPU tier may have no extent free where the index sees room (extents
    granted to workers, a fragmented arena): the chunk stays on disk, loadable."""
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    index.register_node(A, 100, 1000)
    index.admit(A, [offer(0)], now=0)
    index.admit(A, [offer(1)], now=0)  # demotes 0
    answer, actions = hit(index, 0)
    assert actions[A].promote == [sid(0)] and actions[A].demote == [sid(1)]
    assert not index.promoted(A, [], [], [sid(0)])  # nothing dropped
    assert index.shards_on(A) == {(sid(0), DISK), (sid(1), DISK)}
    assert index.nodes()[A][CPU][0] == 0  # the room it was given is free again
    assert index.stats.refused_promotions == 1 and index.stats.corrupt_before_hit == 0
    answer, actions = hit(index, 0)  # still a HIT from disk; promotion asked again
    assert (answer.state, answer.tier) == (LookupState.HIT, DISK)
    assert actions[A].promote == [sid(0)]
    index.promoted(A, [sid(0)], [], [])
    assert (sid(0), CPU) in index.shards_on(A)
    # A restored copy refused stays unverified (PENDING), never dropped.
    index.release(NS, [key(0)], "h")  # so that 7 can have 0's room
    index.restore(A, [(offer(7), DISK)])
    assert hit(index, 7)[1][A].promote == [sid(7)]
    index.promoted(A, [], [], [sid(7)])
    assert hit(index, 7)[0].state is LookupState.PENDING


def test_restore_reindexes_what_a_node_held() -> None:
    index = ChunkIndex()
    index.register_node(A, 100, 1000)
    accepted, actions = index.restore(A, [(offer(0), DISK), (offer(1, parent=0), DISK)])
    assert accepted == [True, True] and not actions
    assert index.shards_on(A) == {(sid(0), DISK), (sid(1), DISK)}
    assert index.units()[(NS, key(1)[:-4])][0] == {(NS, key(0)[:-4])}


def test_arc_keeps_reused_units_through_a_scan_of_one_offs() -> None:
    index = ChunkIndex(policy="arc")
    index.register_node(A, 500)
    index.admit(A, [offer(0), offer(1)], now=0)
    for i in (0, 1):  # reused: they move to ARC's frequency list
        hit(index, i)
        index.release(NS, [key(i)], "h")
    for i in range(10, 30):  # a scan of one-off prefixes
        index.admit(A, [offer(i)], now=0)
    assert {(sid(0), CPU), (sid(1), CPU)} <= index.shards_on(A)


def test_room_for_a_chunk_is_never_made_by_evicting_its_own_parent() -> None:
    index = ChunkIndex()
    index.register_node(A, 200)
    index.admit(A, [offer(0)], now=0)
    index.admit(A, [offer(5)], now=0)
    hit(index, 5)  # 0 is now the least recently used, and a leaf
    index.release(NS, [key(5)], "h")
    result = index.admit(A, [offer(1, parent=0)], now=0)
    assert result.accepted == [True]
    assert result.actions[A].drop == [sid(5)]


def test_offering_the_same_inventory_twice_keeps_everything() -> None:
    """A NodeStore re-registering (Evictor restart, or a race at start) must lose nothing."""
    index = ChunkIndex()
    index.register_node(A, 1000, 1000)
    held = [(offer(i), tier) for i in range(3) for tier in (CPU, DISK)]
    assert index.restore(A, held) == ([True] * 6, {})
    assert index.restore(A, held) == ([True] * 6, {})
    assert index.nodes()[A] == {CPU: (300, 1000, 3), DISK: (300, 1000, 3)}


# ---- what becomes evictable again: the candidate heaps must notice each change ----------


def test_an_engine_that_goes_away_frees_its_leases_at_once() -> None:
    index = ChunkIndex()
    index.register_node(A, 100)
    index.admit(A, [offer(0)], now=0)
    hit(index, 0, ttl=100, holder="engine/1")
    assert index.admit(A, [offer(1)], now=1).accepted == [False]
    index.release_holder("engine/1")
    assert index.admit(A, [offer(1)], now=1).actions[A].drop == [sid(0)]


def test_a_lease_asked_again_with_a_shorter_ttl_frees_its_chunk_at_the_new_expiry() -> None:
    """Found by the reference test: the unit was parked until the first lease's end."""
    index = ChunkIndex()
    index.register_node(A, 100)
    index.admit(A, [offer(0)], now=0)
    hit(index, 0, ttl=100)
    assert index.admit(A, [offer(1)], now=0).accepted == [False]  # 0 leased: parked
    hit(index, 0, ttl=5)  # the same holder asks again: its lease now ends at 5
    assert index.admit(A, [offer(1)], now=6).actions[A].drop == [sid(0)]


def test_a_promoted_chunk_is_evictable_once_its_promotion_is_reported() -> None:
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    index.register_node(A, 100, 1000)
    index.admit(A, [offer(0)], now=0)
    index.admit(A, [offer(1)], now=0)  # demotes 0
    assert hit(index, 0)[1][A].promote == [sid(0)]
    index.release(NS, [key(0)], "h")
    assert index.admit(A, [offer(2)], now=0).accepted == [False]  # 0 is still being promoted
    index.promoted(A, [sid(0)], [], [])
    assert index.admit(A, [offer(2)], now=0).actions[A].demote == [sid(0)]


def test_a_demoted_chunk_disk_copy_makes_room_for_later_write_throughs() -> None:
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    index.register_node(A, 300, 200)
    index.admit(A, [offer(0), offer(1)], now=0)
    # The disk is full of chunks still in memory: 2 is kept in memory only.
    assert index.admit(A, [offer(2)], now=0).actions == {}
    result = index.admit(A, [offer(3)], now=0)
    # 0 leaves memory (its disk copy stays), and that disk-only copy is dropped for 3's.
    assert result.actions[A] == NodeActions(drop=[sid(0)], demote=[sid(0)], persist=[sid(3)])


def test_a_parent_whose_tail_was_dropped_is_the_next_disk_victim() -> None:
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    index.register_node(A, 200, 300)
    index.admit(A, [offer(0), offer(1, parent=0)], now=0)
    assert index.admit(A, [offer(2)], now=0).actions[A].demote == [sid(1)]  # tail first
    result = index.admit(A, [offer(3)], now=0)
    # 0 goes to disk too; for 3's disk copy the oldest disk-only tail goes: 1, not 0.
    assert result.actions[A] == NodeActions(drop=[sid(1)], demote=[sid(0)], persist=[sid(3)])
    # 0 is a disk-only tail now, older than 2: the next disk victim.
    assert index.admit(A, [offer(4)], now=0).actions[A].drop == [sid(0)]
