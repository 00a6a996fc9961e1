"""A NodeStore over two Evictor shards (tierstore.store.evictor_shards): each prefix
tree's chunks go to the shard of their root and to no other, every answer lands on the
shards it belongs to, reports follow the held copy's root, a reregistration with one
shard offers only that shard's part, and a restarted node's disk tier re-offers each
shard what is its own.

Real NodeStoreCore, real tiers, and a real ChunkIndex per shard behind an in-process
port (no Ray): "what each shard indexed" is the index's own books.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import Answered
from tierstore.control.index import ChunkIndex, Watermarks
from tierstore.data.checksum import digest
from tierstore.data.tiers.disk import DiskTier
from tierstore.data.tiers.memory import MemoryTier
from tierstore.errors import ActorUnavailableError, ChunkCorruptError, UnknownNodeError
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName, root_of, shard_of
from tierstore.store.evictor_shards import ShardedEvictorPort, failed_shards
from tierstore.store.node_store import NodeStoreCore
from tierstore.wire import NodeActions, ShardEntry, ShardOffer, UnitOffer

NS = Namespace("5ba2d0")
NODE = NodeId("node-a")
SHARD = 1024
BOUNDARIES = 3  # chunks of each prefix chain
GROUPS = 2  # KV cache groups: a unit is a boundary's groups


def _key(chain: int, boundary: int, group: int) -> ChunkKey:
    return ChunkKey(
        chain.to_bytes(4, "big") + boundary.to_bytes(4, "big") + group.to_bytes(4, "big")
    )


def _chain_on(shard: int, after: int = 0) -> int:
    """A chain whose root maps to ``shard`` of two."""
    chain = after + 1
    while shard_of(root_of(NS, _key(chain, 0, 0)), 2) != shard:
        chain += 1
    return chain


A = _chain_on(0)  # shard 0's prefix tree
B = _chain_on(1)  # shard 1's
ROOTS = {c: root_of(NS, _key(c, 0, 0)) for c in (A, B)}


@dataclass
class IndexShard:
    """One Evictor shard in process: a real ChunkIndex, its own actions answered, the
    one-way reports applied at once; every call recorded."""

    index: ChunkIndex = field(default_factory=ChunkIndex)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def admit_units(self, node_id: str, units: list[UnitOffer]) -> Answered[Any]:
        self.calls.append(("admit_units", units))
        accepted, actions = self.index.admit_units(NodeId(node_id), units, 0.0)
        return Answered((accepted, actions.get(NodeId(node_id), NodeActions())))

    def restore(
        self, node_id: str, held: list[tuple[ShardOffer, TierName]], grace: bool = False
    ) -> Answered[Any]:
        self.calls.append(("restore", held))
        accepted, actions = self.index.restore(NodeId(node_id), held)
        return Answered((accepted, actions.get(NodeId(node_id), NodeActions())))

    def promoted(self, node_id: str, done: Any, failed: Any, refused: Any) -> Answered[None]:
        self.calls.append(("promoted", (done, failed, refused)))
        self.index.promoted(NodeId(node_id), done, failed, refused)
        return Answered(None)

    def forget_shards(self, node_id: str, shard_ids: list[ShardId]) -> Answered[None]:
        self.calls.append(("forget_shards", shard_ids))
        self.index.forget_shards(shard_ids)
        return Answered(None)

    def report_corrupt_after_hit(self, node_id: str, shard_ids: list[ShardId]) -> Answered[None]:
        self.calls.append(("report_corrupt_after_hit", shard_ids))
        self.index.report_corrupt_after_hit(shard_ids)
        return Answered(None)

    def report_disk_writes(
        self, node_id: str, unwritten: list[ShardId], failures: int, writable: bool
    ) -> Answered[None]:
        self.calls.append(("report_disk_writes", (unwritten, failures, writable)))
        self.index.disk_writes(NodeId(node_id), unwritten, failures, writable)
        return Answered(None)

    def replicated(self, node_id: str, done: Any, failed: Any) -> Answered[None]:
        self.calls.append(("replicated", (done, failed)))
        self.index.replicated(NodeId(node_id), done, failed)
        return Answered(None)

    def held(self) -> set[tuple[ShardId, TierName]]:
        return self.index.shards_on(NODE)

    def called(self, method: str) -> list[Any]:
        return [args for name, args in self.calls if name == method]


@dataclass
class Node:
    core: NodeStoreCore
    shards: list[IndexShard]
    port: ShardedEvictorPort
    failures: list[tuple[int, BaseException]]

    def store(self, chains: list[int], rank: int = 0, world_size: int = 1) -> int:
        """One store job holding every chain's chunks, the chains' units interleaved (so
        the answers' order must be kept), each entry with its chain's root."""
        order = [(c, b, g) for b in range(BOUNDARIES) for c in chains for g in range(GROUPS)]
        buffer = np.random.default_rng(rank).integers(0, 256, SHARD * len(order), np.uint8)
        entries = []
        for i, (c, b, g) in enumerate(order):
            data = buffer[i * SHARD : (i + 1) * SHARD]
            parent = _key(c, b - 1, g) if b else None
            entries.append(
                ShardEntry(_key(c, b, g), i * SHARD, SHARD, digest(data), 1, parent, ROOTS[c])
            )
        return self.core.store(NS, rank, world_size, entries, buffer)

    def inventory(self) -> set[tuple[ShardId, TierName]]:
        return self.core.inventory()


def _node(
    disk: DiskTier | None = None,
    cpu_bytes: tuple[int, int] = (1 << 20, 1 << 20),
    registered: tuple[bool, bool] = (True, True),
) -> Node:
    shards = [IndexShard(ChunkIndex(watermarks=Watermarks(high=1.0, low=1.0))) for _ in range(2)]
    disk_bytes = 0 if disk is None else disk.capacity_bytes
    for shard, cpu, known in zip(shards, cpu_bytes, registered, strict=True):
        if known:
            shard.index.register_node(NODE, cpu, disk_bytes)
    failures: list[tuple[int, BaseException]] = []
    core: NodeStoreCore | None = None

    def root_of_held(shard_id: ShardId) -> int | None:
        assert core is not None
        return core.root_of(shard_id)

    port = ShardedEvictorPort(shards, root_of_held, lambda s, e: failures.append((s, e)))
    core = NodeStoreCore(NODE, MemoryTier(4 << 20), disk, port)
    return Node(core, shards, port, failures)


def _ids(chain: int, ranks: int = 1) -> set[ShardId]:
    return {
        ShardId(NS, _key(chain, b, g), r)
        for b in range(BOUNDARIES)
        for g in range(GROUPS)
        for r in range(ranks)
    }


def _cpu(ids: set[ShardId]) -> set[tuple[ShardId, TierName]]:
    return {(s, TierName.CPU) for s in ids}


@pytest.fixture
def node() -> Iterator[Node]:
    yield _node()


def test_each_prefix_tree_goes_to_its_own_shard_and_nowhere_else(node: Node) -> None:
    assert node.store([A, B]) == 2 * BOUNDARIES * GROUPS
    assert node.shards[0].held() == _cpu(_ids(A))
    assert node.shards[1].held() == _cpu(_ids(B))
    # One admit call per shard, each with only its own units, whole (both groups).
    for shard, chain in zip(node.shards, (A, B), strict=True):
        (units,) = shard.called("admit_units")
        assert {u.root for u in units} == {ROOTS[chain]}
        assert all(len(u.shards) == GROUPS for u in units)
    assert node.inventory() == node.shards[0].held() | node.shards[1].held()


def test_what_the_node_keeps_is_what_each_shard_admitted() -> None:
    # Shard 1 has room for one unit of its tree: its answer, not shard 0's, refuses the rest.
    node = _node(cpu_bytes=(1 << 20, GROUPS * SHARD))
    kept = node.store([A, B])
    held = [shard.held() for shard in node.shards]
    assert held[0] == _cpu(_ids(A))
    assert len(held[1]) == GROUPS and {s.key[:4] for s, _ in held[1]} == {B.to_bytes(4, "big")}
    assert node.inventory() == held[0] | held[1]
    assert kept == len(held[0]) + len(held[1])


def test_reports_go_to_the_shard_of_the_held_copys_root(node: Node) -> None:
    node.store([A, B])
    a, b = sorted(_ids(A))[0], sorted(_ids(B))[0]
    gone = ShardId(NS, _key(99, 0, 0), 0)  # not held: its root is not known
    node.port.forget_shards(NODE, [a, b, gone])
    assert node.shards[0].called("forget_shards") == [[a, gone]]
    assert node.shards[1].called("forget_shards") == [[b, gone]]
    node.port.replicated(NODE, [b], [])
    assert node.shards[0].called("replicated") == []
    assert node.shards[1].called("replicated") == [([b], [])]
    # Whether the disk takes writes, every shard needs; the failures are counted once.
    node.port.report_disk_writes(NODE, [a], 3, False)
    assert node.shards[0].called("report_disk_writes") == [([a], 3, False)]
    assert node.shards[1].called("report_disk_writes") == [([], 0, False)]


def test_a_reregistration_with_one_shard_offers_only_its_part(node: Node) -> None:
    node.store([A, B])
    before = [shard.held() for shard in node.shards]
    assert node.core.register_inventory(after_evictor_restart=True, shard=1) == len(before[1])
    assert node.shards[0].called("restore") == []
    (held,) = node.shards[1].called("restore")
    assert {ShardId(o.namespace, o.key, o.rank) for o, _ in held} == _ids(B)
    # Offering a shard what it already indexes changes nothing there.
    assert [shard.held() for shard in node.shards] == before
    assert node.core.register_inventory() == len(before[0]) + len(before[1])
    assert [shard.held() for shard in node.shards] == before
    assert node.inventory() == before[0] | before[1]


def test_a_shard_that_does_not_know_the_node_refuses_only_its_part() -> None:
    node = _node(registered=(True, False))  # shard 1 restarted and has not heard the node
    assert node.store([A, B]) == len(_ids(A))
    assert node.inventory() == _cpu(_ids(A)) == node.shards[0].held()
    assert [(s, type(e)) for s, e in node.failures] == [(1, UnknownNodeError)]
    # Every shard involved failed: the error is raised, naming the shards.
    with pytest.raises(UnknownNodeError) as raised:
        node.store([B], rank=0)
    assert failed_shards(raised.value) == [1]
    assert node.inventory() == _cpu(_ids(A))


def test_one_shard_passes_every_call_straight_through() -> None:
    shard = IndexShard()
    shard.index.register_node(NODE, 1 << 20, 0)
    port = ShardedEvictorPort([shard], lambda s: pytest.fail("no routing with one shard"))
    unit = UnitOffer([ShardOffer(NS, _key(A, 0, 0), 0, 1, SHARD, None, ROOTS[A])])
    reply = port.admit_units(NODE, [unit])
    assert isinstance(reply, Answered) and reply.result() == ([[True]], NodeActions())
    assert isinstance(port.forget_shards(NODE, [ShardId(NS, unit.shards[0].key, 0)]), Answered)
    assert port.shards == len(port) == 1


def test_each_shards_part_survives_a_restart_from_disk(tmp_path: Path) -> None:
    node = _node(disk=DiskTier(tmp_path, 1 << 20))
    node.store([A, B])  # written through: the index plans it with disk room
    assert node.core.disk is not None and len(node.core.disk) == 2 * len(_ids(A))
    node.core.disk.close()

    restarted = _node(disk=DiskTier(tmp_path, 1 << 20))  # fresh memory, fresh shards
    assert restarted.core.root_of(sorted(_ids(B))[0]) == ROOTS[B]
    assert restarted.core.register_inventory() == 2 * len(_ids(A))
    assert restarted.shards[0].held() == {(s, TierName.DISK) for s in _ids(A)}
    assert restarted.shards[1].held() == {(s, TierName.DISK) for s in _ids(B)}


def test_a_shard_let_go_of_is_still_reported_to_its_own_shard(node: Node) -> None:
    node.store([A, B])
    a, b = sorted(_ids(A))[0], sorted(_ids(B))[0]
    node.core.drop([b])
    assert node.core.root_of(b) == ROOTS[B]  # no longer held, its root remembered
    node.port.forget_shards(NODE, [b])
    assert node.shards[0].called("forget_shards") == []
    assert node.shards[1].called("forget_shards") == [[b]]
    # Bytes that change in memory after the HIT: the load fails, and the one shard that
    # indexes the chunk hears of it (counted once in the cluster, not once per shard).
    found = node.core.cpu.find(a)
    assert found is not None
    found.data[0] ^= 0xFF
    with pytest.raises(ChunkCorruptError):
        node.core.load(NS, 0, [a.key])
    assert node.shards[0].called("report_corrupt_after_hit") == [[a]]
    assert node.shards[1].called("report_corrupt_after_hit") == []
    assert [s.index.stats.corrupt_after_hit for s in node.shards] == [1, 0]
    assert (a, TierName.CPU) not in node.shards[0].held()  # its unit forgotten there


def test_a_report_that_cannot_reach_a_shard_reaches_the_others(node: Node) -> None:
    node.store([A, B])
    gone = ShardId(NS, _key(99, 0, 0), 0)  # not held: its report goes to every shard

    def dead(node_id: str, shard_ids: list[ShardId]) -> Answered[None]:
        raise ActorUnavailableError("Evictor shard 0 is gone")

    node.shards[0].forget_shards = dead  # type: ignore[method-assign]
    node.port.forget_shards(NODE, [gone])
    assert node.shards[1].called("forget_shards") == [[gone]]
    assert [(s, type(e)) for s, e in node.failures] == [(0, ActorUnavailableError)]
