"""The index told of failed disk writes (ChunkIndex.disk_writes): shards written through in
vain lose only their disk copy, and while a node's disk takes no writes nothing is
demoted or written through there: room comes from dropping, as on a node without disk."""

from __future__ import annotations

from tierstore.control.index import ChunkIndex, ShardOffer, Watermarks
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName

NS = Namespace("d15c")
NODE = NodeId("n1")
SHARD = 100


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\0")


def _sid(i: int) -> ShardId:
    return ShardId(NS, _key(i), 0)


def _offer(i: int) -> ShardOffer:
    return ShardOffer(NS, _key(i), 0, 1, SHARD)  # each its own chain: every unit a tail


def _index() -> ChunkIndex:
    index = ChunkIndex("lru", Watermarks(0.95, 0.85))
    index.register_node(NODE, 4 * SHARD, 10 * SHARD)
    return index


def test_unwritten_shards_keep_their_memory_copy_and_lose_only_the_disk_one() -> None:
    index = _index()
    result = index.admit(NODE, [_offer(i) for i in range(3)], now=0.0)
    assert result.actions[NODE].persist == [_sid(i) for i in range(3)]
    assert (_sid(0), TierName.DISK) in index.shards_on(NODE)

    forgotten = index.disk_writes(NODE, [_sid(1), _sid(2)], failures=1, writable=True)
    assert forgotten == [_sid(1), _sid(2)]
    held = index.shards_on(NODE)
    assert {(_sid(i), TierName.CPU) for i in range(3)} <= held
    assert (_sid(0), TierName.DISK) in held
    assert not {(_sid(1), TierName.DISK), (_sid(2), TierName.DISK)} & held
    assert index.nodes()[NODE][TierName.DISK] == (SHARD, 10 * SHARD, 1)
    assert index.stats.disk_write_failures == 1
    assert len(index) == 3  # nothing forgotten


def test_while_the_disk_takes_no_writes_room_comes_from_drops_and_nothing_is_written() -> None:
    index = _index()
    index.admit(NODE, [_offer(i) for i in range(4)], now=0.0)  # the CPU tier is full
    index.disk_writes(NODE, [_sid(i) for i in range(4)], failures=1, writable=False)
    assert index.nodes()[NODE][TierName.DISK] == (0, 0, 0)  # its capacity parked

    result = index.admit(NODE, [_offer(4)], now=1.0)
    assert result.accepted == [True]
    actions = result.actions[NODE]
    assert actions.drop == [_sid(0)]  # the oldest, dropped: it had no disk copy to keep
    assert not actions.demote and not actions.persist
    assert index.stats.evicted_chunks == 1 and index.stats.demoted_shards == 0

    # The retry is due: writes are planned again, room made by demoting to disk (down
    # to the low watermark, which a disk taking no writes skipped).
    index.disk_writes(NODE, [], failures=0, writable=True)
    assert index.nodes()[NODE][TierName.DISK][1] == 10 * SHARD
    actions = index.admit(NODE, [_offer(5)], now=2.0).actions[NODE]
    assert actions.demote == [_sid(1), _sid(2)] and actions.persist == [_sid(5)]


def test_a_shard_demoted_since_or_another_nodes_is_not_touched() -> None:
    index = _index()
    index.register_node(NodeId("n2"), 4 * SHARD, 10 * SHARD)
    index.admit(NODE, [_offer(i) for i in range(4)], now=0.0)
    index.admit(NODE, [_offer(4)], now=1.0)  # demotes shard 0: its memory copy is gone
    assert (_sid(0), TierName.CPU) not in index.shards_on(NODE)
    assert index.disk_writes(NODE, [_sid(0)], failures=0, writable=True) == []
    assert index.disk_writes(NodeId("n2"), [_sid(1)], failures=0, writable=True) == []
    assert (_sid(0), TierName.DISK) in index.shards_on(NODE)
    assert (_sid(1), TierName.DISK) in index.shards_on(NODE)


def test_a_restarted_node_registers_a_writable_disk() -> None:
    index = _index()
    index.disk_writes(NODE, [], failures=2, writable=False)
    index.register_node(NODE, 4 * SHARD, 10 * SHARD)
    assert index.nodes()[NODE][TierName.DISK][1] == 10 * SHARD
    index.disk_writes(NODE, [], failures=0, writable=True)  # no parked capacity: unchanged
    assert index.nodes()[NODE][TierName.DISK][1] == 10 * SHARD
    assert index.stats.disk_write_failures == 2
    assert index.disk_writes(NodeId("gone"), [_sid(0)], failures=1, writable=False) == []
