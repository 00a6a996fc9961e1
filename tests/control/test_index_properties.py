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

from actors.node_store import NodeStoreCore, ShardEntry
from tierstore.control.index import (
    Actions,
    AdmitResult,
    ChunkIndex,
    LookupState,
    NodeActions,
    ShardOffer,
    UnitId,
    Watermarks,
)
from tierstore.data.checksum import digest
from tierstore.data.tiers.disk import DiskTier
from tierstore.data.tiers.memory import MemoryTier
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName, boundary_of

NS = Namespace("c0ffee")
NODES = [NodeId("n0"), NodeId("n1")]
CHAIN = 4  # boundaries i and i+1 are linked unless i+1 starts a new chain
GROUPS = 2


class LocalEvictor:
    """The EvictorPort of an in-process cluster."""

    def __init__(self, index: ChunkIndex) -> None:
        self.index = index
        self.now = 0.0
        self.cores: dict[NodeId, NodeStoreCore] = {}

    def deliver(self, actions: Actions, skip: NodeId | None = None) -> None:
        for node, node_actions in actions.items():
            if node != skip and node in self.cores:
                self.cores[node].apply(node_actions)

    def admit(self, node: NodeId, offers: list[ShardOffer]) -> AdmitResult:
        result = self.index.admit(node, offers, self.now)
        self.deliver(result.actions, skip=node)
        return result

    def restore(self, node, held, grace=False):  # type: ignore[no-untyped-def]
        accepted, actions = self.index.restore(node, held)
        self.deliver(actions, skip=node)
        return accepted, actions.get(node, NodeActions())

    def promoted(self, node: NodeId, done: list[ShardId], failed: list[ShardId]) -> None:
        self.deliver(self.index.promoted(node, done, failed))

    def forget(self, node: NodeId, shard_ids: list[ShardId]) -> None:
        self.deliver(self.index.forget_shards(shard_ids))

    def corrupt_after_hit(self, node: NodeId, shard_ids: list[ShardId]) -> None:
        self.deliver(self.index.report_corrupt_after_hit(shard_ids))


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
    ),
    max_size=50,
)


@settings(
    max_examples=int(os.environ.get("TIERSTORE_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(ops=ops, policy=st.sampled_from(["lru", "arc"]), with_disk=st.booleans())
def test_invariants_hold_for_any_operation_sequence(ops, policy: str, with_disk: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        index = ChunkIndex(policy, Watermarks(0.9, 0.7))
        evictor = LocalEvictor(index)
        disk_bytes = 400 if with_disk else 0
        for node in NODES:
            index.register_node(node, 300, disk_bytes)
            disk = DiskTier(Path(tmp) / node, disk_bytes) if with_disk else None
            evictor.cores[node] = NodeStoreCore(node, MemoryTier(300), disk, evictor)
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
                answers, actions = index.lookup(NS, keys, holder, evictor.now, 10.0)
                evictor.deliver(actions)
                for k, answer in zip(keys, answers, strict=True):
                    if answer.state is not LookupState.MISS:
                        leases[(holder, k)] = evictor.now + 10.0
            elif op == "release":
                holder = f"h{a}"
                index.release_holder(holder)
                leases = {hk: t for hk, t in leases.items() if hk[0] != holder}
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
