"""Property-based: the Evictor's invariants hold under random sequences of operations.

A small cluster runs in-process: real NodeStoreCores with a real CPU tier and a real disk
tier (files in a temporary directory), wired to one ChunkIndex. Delivery of the index's
one-way messages is immediate, as an idle Ray cluster would deliver them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import Answered
from tierstore.control.index import (
    Actions,
    ChunkIndex,
    LookupState,
    NodeActions,
    UnitId,
    Watermarks,
)
from tierstore.data.checksum import digest
from tierstore.data.tiers.disk import DiskTier
from tierstore.data.tiers.memory import MemoryTier
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName, boundary_of
from tierstore.store.node_store import NodeStoreCore
from tierstore.wire import ShardEntry, UnitOffer

NS = Namespace("c0ffee")
NODES = [NodeId("n0"), NodeId("n1"), NodeId("n2")]  # stores go to n0 and n1
CHAIN = 4  # boundaries i and i+1 are linked unless i+1 starts a new chain
GROUPS = 2


class LocalEvictor:
    """The EvictorPort of an in-process cluster."""

    def __init__(self, index: ChunkIndex, cpu_short: int = 0) -> None:
        self.index = index
        # Bytes the nodes' CPU tiers hold fewer than the index counts (room it cannot
        # see: extents granted to workers, a fragmented arena): they refuse some stores
        # and promotions.
        self.cpu_short = cpu_short
        self.now = 0.0
        self.cores: dict[NodeId, NodeStoreCore] = {}
        self.started = 0

    def deliver(self, actions: Actions, skip: NodeId | None = None) -> None:
        for node, node_actions in actions.items():
            if node != skip and node in self.cores:
                self.cores[node].apply(node_actions)

    def admit_units(
        self, node: NodeId, units: list[UnitOffer]
    ) -> Answered[tuple[list[list[bool]], NodeActions]]:
        accepted, actions = self.index.admit_units(node, units, self.now)
        self.deliver(actions, skip=node)
        return Answered((accepted, actions.get(node, NodeActions())))

    def restore(self, node, held, grace=False):  # type: ignore[no-untyped-def]
        accepted, actions = self.index.restore(node, held)
        self.deliver(actions, skip=node)
        return Answered((accepted, actions.get(node, NodeActions())))

    def promoted(
        self, node: NodeId, done: list[ShardId], failed: list[ShardId], refused: list[ShardId]
    ) -> None:
        self.deliver(self.index.promoted(node, done, failed, refused))

    def forget_shards(self, node: NodeId, shard_ids: list[ShardId]) -> None:
        self.deliver(self.index.forget_shards(shard_ids))

    def report_corrupt_after_hit(self, node: NodeId, shard_ids: list[ShardId]) -> None:
        self.deliver(self.index.report_corrupt_after_hit(shard_ids))

    def replicated(self, node: NodeId, done: list[ShardId], failed: list[ShardId]) -> None:
        self.deliver(self.index.replicated(node, done, failed))

    def report_disk_writes(
        self, node: NodeId, unwritten: list[ShardId], failures: int, writable: bool
    ) -> None:
        self.index.disk_writes(node, unwritten, failures, writable)

    # The PeerPort too: replica pushes reach the other core at once.
    def accept_replicas(self, node: NodeId, shards, views) -> None:  # type: ignore[no-untyped-def]
        if node in self.cores:
            self.cores[node].accept_replicas(shards, views)

    def start_node(self, node: NodeId, root: Path, cpu_bytes: int, disk_bytes: int) -> None:
        """A node with empty tiers (again, after a loss: the old files went with it)."""
        self.index.register_node(node, cpu_bytes, disk_bytes)
        self.started += 1  # a fresh directory each time
        disk = DiskTier(root / f"{node}-{self.started}", disk_bytes) if disk_bytes else None
        cpu = MemoryTier(cpu_bytes - self.cpu_short)
        self.cores[node] = NodeStoreCore(node, cpu, disk, self, peers=self)


def key(boundary: int, group: int) -> ChunkKey:
    return ChunkKey(boundary.to_bytes(8, "big") + group.to_bytes(4, "big"))


def parent_of(boundary: int) -> int | None:
    return boundary - 1 if boundary % CHAIN else None


ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 1), st.integers(0, 11), st.integers(10, 90)),
        st.tuples(st.just("lookup"), st.integers(0, 3), st.integers(0, 11), st.just(0)),
        st.tuples(st.just("release"), st.integers(0, 3), st.just(0), st.just(0)),
        st.tuples(st.just("tick"), st.integers(1, 20), st.just(0), st.just(0)),
        # an engine on node ``a`` loads boundary ``b`` (a hot one gets a replica there);
        # node 2 stores nothing of its own, so replicas find room there
        st.tuples(st.just("load"), st.integers(0, 2), st.integers(0, 11), st.just(0)),
        st.tuples(st.just("lose"), st.integers(0, 2), st.just(0), st.just(0)),
    ),
    max_size=80,
)


@settings(
    max_examples=int(os.environ.get("TIERSTORE_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    ops=ops,
    policy=st.sampled_from(["lru", "arc"]),
    with_disk=st.booleans(),
    replicate_after=st.sampled_from([0, 1, 2]),
    cpu_short=st.sampled_from([0, 0, 120]),
)
def test_invariants_hold_for_any_operation_sequence(
    ops, policy: str, with_disk: bool, replicate_after: int, cpu_short: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        index = ChunkIndex(policy, Watermarks(0.9, 0.7), replicate_after_loads=replicate_after)
        evictor = LocalEvictor(index, cpu_short)
        disk_bytes = 400 if with_disk else 0
        for node in NODES:
            evictor.start_node(node, Path(tmp), 300, disk_bytes)
        leases: dict[tuple[str, ChunkKey], float] = {}  # (holder, key) -> expiry, as granted
        previous_units: dict[UnitId, tuple[set[UnitId], set[UnitId]]] = {}
        previous: set[ChunkKey] = set()
        rng = np.random.default_rng(0)

        for op, a, b, c in ops:
            if op == "store":
                parent = parent_of(b)
                entries, offset = [], 0
                for g in range(GROUPS):
                    entries.append(
                        ShardEntry(
                            key(b, g),
                            offset,
                            c,
                            0,
                            1,
                            key(parent, g) if parent is not None else None,
                        )
                    )
                    offset += c
                buffer = rng.integers(0, 255, offset, dtype=np.uint8)
                entries = [
                    e._replace(digest=digest(buffer[e.offset : e.offset + e.nbytes]))
                    for e in entries
                ]
                evictor.cores[NODES[a]].store(NS, 0, 1, entries, buffer)
            elif op == "lookup":
                holder = f"h{a}"
                keys = [key(b, g) for g in range(GROUPS)]
                stored = {sid.key for n in NODES for sid, _ in index.shards_on(n)}
                answers, actions = index.lookup(NS, keys, holder, evictor.now, 10.0)
                evictor.deliver(actions)
                for k, answer in zip(keys, answers, strict=True):
                    # 5. A stored chunk is never a MISS: promoted (PENDING), or a HIT
                    # from memory or, with no CPU room to promote it, from disk.
                    assert (answer.state is LookupState.MISS) == (k not in stored), k.hex()
                    if answer.state is not LookupState.MISS:
                        leases[(holder, k)] = evictor.now + 10.0
            elif op == "release":
                holder = f"h{a}"
                index.release_holder(holder)
                leases = {hk: t for hk, t in leases.items() if hk[0] != holder}
            elif op == "load":
                # Mostly a boundary that is resident (any one would rarely be).
                held = sorted({sid.key[:8] for n in NODES for sid, _ in index.shards_on(n)})
                if held:
                    b = int.from_bytes(held[b % len(held)], "big")
                keys = [key(b, g) for g in range(GROUPS)]
                answers, actions = index.lookup(NS, keys, "loader", evictor.now, 10.0, NODES[a])
                evictor.deliver(actions)
                hits = [
                    k for k, ans in zip(keys, answers, strict=True) if ans.state is LookupState.HIT
                ]
                for k, answer in zip(keys, answers, strict=True):
                    if answer.state is LookupState.HIT:  # the bytes are where it says
                        (node,) = set(answer.where.values())
                        assert evictor.cores[node].load(NS, 0, [k])[0].nbytes > 0
                        if answer.tier is TierName.CPU:
                            assert ShardId(NS, k, 0) in evictor.cores[node].cpu
                index.release(NS, keys, "loader")
                evictor.deliver(index.record_loads(NS, hits, NODES[a]))
            elif op == "lose":
                lost = NODES[a]
                del evictor.cores[lost]
                evictor.deliver(index.forget_node(lost))
                evictor.start_node(lost, Path(tmp), 300, disk_bytes)
                # Leases of chunks that went with the node went with them.
                resident = {sid.key for n in NODES for sid, _ in index.shards_on(n)}
                leases = {hk: t for hk, t in leases.items() if hk[1] in resident}
                previous_units = {}  # a forced drop may take a parent and keep a child
            else:
                evictor.now += a

            # 1. Capacity is never exceeded, in the index or in the tiers themselves.
            for node, tiers in index.nodes().items():
                for tier, (used, cap, _) in tiers.items():
                    assert used <= cap, (node, tier, used, cap)
                core = evictor.cores[node]
                assert core.cpu.used_bytes <= core.cpu.capacity_bytes
                if core.disk is not None:
                    assert core.disk.used_bytes <= core.disk.capacity_bytes
            # 2. The index equals the NodeStores' inventories.
            for node, core in evictor.cores.items():
                assert index.shards_on(node) == core.inventory(), node
            # 3. Leased (and so pinned) chunks that were present are never evicted.
            resident = {sid.key for n in NODES for sid, _ in index.shards_on(n)}
            for (_, k), expiry in leases.items():
                if expiry > evictor.now:
                    assert k in resident, k.hex()
            # 4. No unit is dropped while a unit it is the parent of remains.
            units = index.units()
            for dropped in previous_units.keys() - units.keys():
                for child in previous_units[dropped][1]:
                    assert child not in units, (dropped, child)
            previous_units = units
            # Every group at a boundary is evicted together: none outlives a dropped sibling.
            gone = previous - resident
            for k in gone:
                siblings = {s for s in previous if boundary_of(s) == boundary_of(k)}
                assert not siblings & resident, k.hex()
            previous = resident
            # A loadable (HIT) chunk always has its bytes in memory.
            for node, core in evictor.cores.items():
                for sid, tier in index.shards_on(node):
                    if tier is TierName.CPU:
                        assert sid in core.cpu
