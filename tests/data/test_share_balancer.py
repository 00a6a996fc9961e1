"""ShareBalancer: a node's tiers moved between Evictor shards by credit (no Ray: each
shard is a real ChunkIndex behind an in-process double of its client).

What a serving engineer cares about: stores skewed to one shard's prefix trees get most
of the node within a few rounds and keep it; the shards' shares never add up to more
than the node's tier, at any instant; a giver evicts down to its new share through its
normal path (demoting before dropping) and its actions reach the node before any taker
grows; a cold shard keeps room to admit; a shard that does not answer moves nothing.
"""

from __future__ import annotations

import pytest

from tests.support import Answered
from tierstore.control.index import ChunkIndex, ShardOffer
from tierstore.control.shares import share_floor
from tierstore.keys import ChunkKey, Namespace, NodeId, TierName
from tierstore.store.evictor_shards import ShareBalancer, ShareBook
from tierstore.wire import NodeActions, NodeLoad

NS = Namespace("balance")
NODE = NodeId("n0")
CPU = 1000
DISK = 4000
SHARD = 10


class Shard:
    """One Evictor shard's calls a balancer makes, on a real index; counts as the
    Evictor actor does (pressure: evictions, demotions and refusals of stores)."""

    def __init__(self, cpu: int, disk: int, log: list[tuple[str, int]], n: int) -> None:
        self.index = ChunkIndex()
        self.index.register_node(NODE, cpu, disk)
        self.pressure = 0
        self.asked = 0
        self.log = log
        self.n = n
        self.down = False

    def store(self, first: int, length: int) -> list[bool]:
        stats = self.index.stats
        before = stats.evicted_chunks + stats.demoted_shards + stats.skipped_stores
        parent = None
        offers = []
        for i in range(length):
            key = ChunkKey(first.to_bytes(4, "big") + i.to_bytes(4, "big"))
            offers.append(ShardOffer(NS, key, 0, 1, SHARD, parent))
            parent = key
        result = self.index.admit(NODE, offers, 0.0)
        self.pressure += stats.evicted_chunks + stats.demoted_shards + stats.skipped_stores - before
        self.asked += 1
        return result.accepted

    def load(self) -> NodeLoad:
        tiers = self.index.nodes()[NODE]
        cu, cc, _ = tiers[TierName.CPU]
        du, dc, _ = tiers[TierName.DISK]
        return NodeLoad(cc, cu, dc, du, self.pressure, self.asked)

    def node_load(self, node_id: str) -> Answered[NodeLoad | None]:
        if self.down:
            raise TimeoutError(f"shard {self.n} did not answer")
        return Answered(self.load())

    def resize_node(
        self, node_id: str, cpu: int, disk: int
    ) -> Answered[tuple[NodeLoad | None, NodeActions]]:
        if self.down:
            raise TimeoutError(f"shard {self.n} did not answer")
        actions = self.index.resize_node(NODE, cpu, disk, 0.0)
        self.log.append(("resize", self.n))
        return Answered((self.load(), actions.get(NODE, NodeActions())))


class Node:
    """Two shards of one node, its static split, and the balancer over them."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.shards = [Shard(CPU // 2, DISK // 2, self.log, n) for n in range(2)]
        self.book = ShareBook([CPU // 2] * 2, [DISK // 2] * 2)
        self.applied: list[NodeActions] = []
        self.sums: list[tuple[int, int]] = []
        self.balancer = ShareBalancer(str(NODE), self.shards, self.book, CPU, DISK, self.apply)

    def apply(self, actions: NodeActions) -> None:
        self.applied.append(actions)
        self.log.append(("apply", -1))

    def shares(self) -> tuple[int, int]:
        cpu = sum(s.index.nodes()[NODE][TierName.CPU][1] for s in self.shards)
        disk = sum(s.index.nodes()[NODE][TierName.DISK][1] for s in self.shards)
        return cpu, disk

    def round(self) -> bool:
        moved = self.balancer.run_round()
        self.sums.append(self.shares())
        return moved


def _held(shard: Shard, tier: TierName) -> int:
    return shard.index.nodes()[NODE][tier][0]


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> Node:
    made = Node()
    # every resize checks the invariant at that instant: shares add up to the tier
    for shard in made.shards:
        resize = shard.resize_node

        def checked(node_id: str, cpu: int, disk: int, _resize=resize) -> object:  # type: ignore[no-untyped-def]
            answer = _resize(node_id, cpu, disk)
            cpu_sum, disk_sum = made.shares()
            assert cpu_sum <= CPU and disk_sum <= DISK
            return answer

        monkeypatch.setattr(shard, "resize_node", checked)
    return made


def test_skewed_stores_get_the_whole_node_but_the_cold_floor(node: Node) -> None:
    hot, cold = node.shards
    cold.store(10_000, 2)
    for round_ in range(12):
        for first in range(round_ * 20, round_ * 20 + 20):
            hot.store(first, 3)
        node.round()
    floor_cpu, floor_disk = share_floor(CPU, 2), share_floor(DISK, 2)
    assert hot.load().cpu_capacity >= CPU - floor_cpu - 2 * SHARD
    assert hot.load().disk_capacity >= DISK - floor_disk - 2 * SHARD
    assert _held(hot, TierName.CPU) > CPU // 2 and _held(hot, TierName.DISK) > DISK // 2
    assert node.book.cpu == [s.load().cpu_capacity for s in node.shards]  # re-registers these
    assert all(cpu <= CPU and disk <= DISK for cpu, disk in node.sums)
    assert cold.store(20_000, 2) == [True, True]  # the cold shard still admits
    assert len(cold.index) == 4


def test_a_giver_demotes_first_and_its_actions_reach_the_node_before_a_taker_grows(
    node: Node,
) -> None:
    hot, cold = node.shards
    for first in range(30):  # the cold shard fills its half, then goes quiet
        cold.store(50_000 + first, 1)
    cold.asked = 0
    node.balancer.run_round()  # a round to see the counts from here
    for first in range(60):
        hot.store(first, 2)
    assert node.round()
    assert (
        node.log.index(("resize", 1))
        < node.log.index(("apply", -1))
        < node.log.index(("resize", 0))
    )
    demoted = [s for a in node.applied for s in a.demote]
    assert demoted and not [s for a in node.applied for s in a.drop]
    assert len(cold.index) == 30  # demoted to disk, not dropped


def test_a_shard_that_does_not_answer_moves_nothing(node: Node) -> None:
    hot, cold = node.shards
    for first in range(60):
        hot.store(first, 2)
    cold.down = True
    with pytest.raises(TimeoutError):
        node.balancer.run_round()
    assert [s.index.nodes()[NODE][TierName.CPU][1] for s in node.shards] == [CPU // 2] * 2
    cold.down = False
    assert node.round()
    assert hot.load().cpu_capacity > CPU // 2


class Fixed:
    """A shard's answers set by hand: it holds ``used`` bytes per tier, was pressed."""

    def __init__(self, caps: list[int], used: list[int], all_caps: list[list[int]]) -> None:
        self.caps, self.used, self.all_caps = caps, used, all_caps
        self.pressure = 0

    def load(self) -> NodeLoad:
        c, d = self.caps
        return NodeLoad(c, min(self.used[0], c), d, min(self.used[1], d), self.pressure, 1)

    def node_load(self, node_id: str) -> Answered[NodeLoad | None]:
        return Answered(self.load())

    def resize_node(
        self, node_id: str, cpu: int, disk: int
    ) -> Answered[tuple[NodeLoad | None, NodeActions]]:
        self.caps[:] = [cpu, disk]
        assert sum(c[0] for c in self.all_caps) <= CPU
        assert sum(c[1] for c in self.all_caps) <= DISK
        return Answered((self.load(), NodeActions()))


def test_a_shard_giving_in_one_tier_and_taking_in_the_other_keeps_the_sum() -> None:
    """Shard 0 is pressed in memory and holds nothing on disk, shard 1 the other way:
    each gives in one tier and takes in the other; no resize has either tier over."""
    caps = [[CPU // 2, DISK // 2], [CPU // 2, DISK // 2]]
    zero = Fixed(caps[0], [CPU, 0], caps)
    one = Fixed(caps[1], [0, DISK], caps)
    book = ShareBook([CPU // 2] * 2, [DISK // 2] * 2)
    balancer = ShareBalancer(str(NODE), [zero, one], book, CPU, DISK, lambda a: None)
    balancer.run_round()  # the counts seen from here
    zero.pressure = one.pressure = 5
    assert balancer.run_round()
    assert caps[0][0] > CPU // 2 and caps[0][1] < DISK // 2
    assert caps[1][0] < CPU // 2 and caps[1][1] > DISK // 2
    assert book.cpu == [c[0] for c in caps] and book.disk == [c[1] for c in caps]
