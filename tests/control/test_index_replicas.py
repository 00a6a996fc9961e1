"""Hot-chunk replicas in the index: when one is made, what a lookup names, what goes first,
and how a replica keeps a chunk alive when its holder is lost."""

from __future__ import annotations

from tests.control.test_index import CPU, DISK, NS, A, B, key, offer, sid
from tierstore.control.index import ChunkIndex, LookupState, Watermarks
from tierstore.keys import NodeId

C = NodeId("node-c")


def _cluster(cpu: int = 1000, disk: int = 0, after: int = 2) -> ChunkIndex:
    index = ChunkIndex("lru", Watermarks(0.9, 0.5), replicate_after_loads=after)
    for node in (A, B, C):
        index.register_node(node, cpu, disk)
    return index


def _load_from(index: ChunkIndex, node: NodeId, i: int, world: int = 1):  # type: ignore[no-untyped-def]
    """One engine on ``node`` looks chunk ``i`` up, loads it, and says so."""
    (answer,), _ = index.lookup(NS, [key(i)], "h", 0, 10, node)
    assert answer.state is LookupState.HIT
    index.release(NS, [key(i)], "h")
    return answer, index.record_loads(NS, [key(i)], node)


def _land(index: ChunkIndex, node: NodeId, i: int, world: int = 1) -> None:
    assert index.replicated(node, [sid(i, r) for r in range(world)], []) == {}


def test_a_node_that_keeps_loading_a_chunk_gets_a_replica_and_loads_it_locally() -> None:
    index = _cluster()
    index.admit(A, [offer(0)], now=0)
    answer, actions = _load_from(index, B, 0)
    assert answer.where == {0: A} and actions == {}  # one load: not hot yet
    answer, actions = _load_from(index, B, 0)
    assert actions[A].push == [(sid(0), B)]  # the holder sends it
    assert index.nodes()[B][CPU] == (100, 1000, 1)  # room reserved at once
    # Not a HIT from B until it has landed.
    (answer,), _ = index.lookup(NS, [key(0)], "h", 0, 10, B)
    assert answer.where == {0: A}
    _land(index, B, 0)
    (answer,), _ = index.lookup(NS, [key(0)], "h", 0, 10, B)
    assert answer.where == {0: B}
    (answer,), _ = index.lookup(NS, [key(0)], "h", 0, 10, C)  # other nodes: the original
    assert answer.where == {0: A}
    assert index.stats.replicated_chunks == 1
    assert index.replicas_on(B) == {(NS, key(0))}
    assert index.shards_on(B) == {(sid(0), CPU)}


def test_every_rank_must_land_before_the_replica_serves() -> None:
    index = _cluster()
    index.admit(A, [offer(0, rank=0, world=2)], now=0)
    index.admit(C, [offer(0, rank=1, world=2)], now=0)
    _load_from(index, B, 0)
    _, actions = _load_from(index, B, 0)
    assert actions[A].push == [(sid(0, 0), B)] and actions[C].push == [(sid(0, 1), B)]
    index.replicated(B, [sid(0, 0)], [])
    (answer,), _ = index.lookup(NS, [key(0)], "h", 0, 10, B)
    assert answer.where == {0: A, 1: C}
    index.replicated(B, [sid(0, 1)], [])
    (answer,), _ = index.lookup(NS, [key(0)], "h", 0, 10, B)
    assert answer.where == {0: B, 1: B}


def test_no_replica_without_room_below_the_low_watermark_and_none_on_the_holder() -> None:
    index = _cluster(cpu=300)  # low watermark 150 bytes
    index.admit(A, [offer(0)], now=0)
    index.admit(B, [offer(1)], now=0)  # B at 100 of 300: one more chunk would pass 150
    for _ in range(3):
        _, actions = _load_from(index, B, 0)
        assert actions == {}
        _, actions = _load_from(index, A, 0)  # the holder's own loads never replicate
        assert actions == {}
    assert index.replicas_on(B) == set()
    assert _cluster(after=0).record_loads(NS, [key(0)], B) == {}  # 0 = never


def test_a_failed_push_frees_the_reserved_room() -> None:
    index = _cluster()
    index.admit(A, [offer(0)], now=0)
    _load_from(index, B, 0)
    _load_from(index, B, 0)
    actions = index.replicated(B, [], [sid(0)])
    assert actions[B].drop == [sid(0)]
    assert index.nodes()[B][CPU] == (0, 1000, 0)
    _, actions = _load_from(index, B, 0)  # asked again on the next loads
    _, actions = _load_from(index, B, 0)
    assert actions[A].push == [(sid(0), B)]


def test_replicas_are_evicted_first_and_never_while_leased() -> None:
    index = _cluster(cpu=400, after=1)  # low watermark 200
    index.admit(A, [offer(0), offer(1)], now=0)
    for i in (0, 1):
        _load_from(index, B, i)
        _land(index, B, i)
    assert index.replicas_on(B) == {(NS, key(0)), (NS, key(1))}
    index.admit(B, [offer(2), offer(3)], now=0)  # B is full now
    index.lookup(NS, [key(1)], "h2", 0, 10, B)  # leased: stays
    result = index.admit(B, [offer(4)], now=0)  # a replica goes, not a chunk
    assert result.accepted == [True]
    assert result.actions[B].drop == [sid(0)]
    assert index.replicas_on(B) == {(NS, key(1))}
    assert index.stats.evicted_chunks == 0
    assert (NS, key(0)) in index  # the chunk itself lives on at A


def test_dropping_a_chunk_drops_its_replicas() -> None:
    index = _cluster(cpu=200, after=1)
    index.admit(A, [offer(0)], now=0)
    _load_from(index, B, 0)
    _land(index, B, 0)
    result = index.admit(A, [offer(1), offer(2)], now=0)  # chunk 0 evicted at A
    assert sid(0) in result.actions[A].drop and result.actions[B].drop == [sid(0)]
    assert index.nodes()[B][CPU] == (0, 200, 0)
    assert index.replicas_on(B) == set()


def test_a_replica_keeps_the_chunk_when_its_holder_is_lost() -> None:
    index = _cluster(disk=1000, after=1)
    index.admit(A, [offer(0), offer(1, parent=0), offer(2, parent=1)], now=0)
    _load_from(index, B, 0)
    _load_from(index, B, 1)
    _land(index, B, 0)
    _land(index, B, 1)
    actions = index.forget_node(A)
    # 0 and 1 now belong to B (written through to its disk); 2 had no replica: gone.
    assert sorted(actions[B].persist) == [sid(0), sid(1)]
    assert A not in actions
    assert (NS, key(2)) not in index and (NS, key(0)) in index
    (answer,), _ = index.lookup(NS, [key(1)], "h", 0, 10, C)
    assert answer.where == {0: B}
    assert index.shards_on(B) == {(sid(0), CPU), (sid(0), DISK), (sid(1), CPU), (sid(1), DISK)}
    assert index.replicas_on(B) == set()
    assert index.nodes()[B][CPU] == (200, 1000, 2)
    # B's copies are ordinary chunks now: losing B loses them.
    index.forget_node(B)
    assert len(index) == 0


def test_losing_the_replica_node_only_loses_the_replica() -> None:
    index = _cluster(after=1)
    index.admit(A, [offer(0)], now=0)
    _load_from(index, B, 0)
    _land(index, B, 0)
    assert index.forget_node(B) == {}
    (answer,), _ = index.lookup(NS, [key(0)], "h", 0, 10, B)
    assert answer.where == {0: A}


def test_after_an_evictor_restart_one_copy_is_kept_and_the_other_dropped() -> None:
    """Both nodes offer the shard they hold; the new index keeps one holder per shard."""
    index = _cluster()
    held = [(offer(0), CPU)]
    accepted, actions = index.restore(A, held)
    assert accepted == [True] and actions == {}
    accepted, actions = index.restore(B, held)  # B's former replica
    assert accepted == [False] and actions[B].drop == [sid(0)]
    (answer,), _ = index.lookup(NS, [key(0)], "h", 0, 10, B)
    assert answer.where == {0: A}
