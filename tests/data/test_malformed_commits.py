"""A worker's malformed store is refused whole, counted, and changes no book.

Real objects on a real arena file: the node's ArenaTier and NodeStoreCore, its
ArenaStore (what the actor's ``arena_commit`` and ``store`` call), and a real ChunkIndex
behind the Evictor port, so "the books" are the real ones: the NodeStore's stats, the
tier's shards and bytes, the allocator's holes, the extents granted, the arena's
directory and generation tables byte for byte, and the index's contents and counts.
A malformed field (negative ``nbytes``, a digest past 64 bits, an extent the worker does
not hold, a key of the wrong length, a shard twice in one job...) refuses its job and
changes nothing else; the other jobs of the same call are kept; a good commit after it
works.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import Answered
from tierstore.control.index import ChunkIndex, NodeActions
from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.region import ArenaRegion
from tierstore.data.checksum import digest
from tierstore.data.tiers.arena import ArenaTier
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName
from tierstore.store.arena_store import ArenaStore
from tierstore.store.node_store import NodeStoreCore
from tierstore.wire import RefusedCommit, ShardEntry, UnitOffer

NS = Namespace("c0c0a1a1")
NODE = NodeId("node-under-test")
KiB = 1 << 10
SHARD = 4 * KiB


class IndexPort:
    """The Evictor port over a real ChunkIndex, in process (one node: its own actions
    come back in the answers; the one-way reports reach the index at once)."""

    def __init__(self, index: ChunkIndex) -> None:
        self.index = index

    def admit_units(
        self, node_id: NodeId, units: list[UnitOffer]
    ) -> Answered[tuple[list[list[bool]], NodeActions]]:
        accepted, actions = self.index.admit_units(node_id, units, 0.0)
        return Answered((accepted, actions.get(node_id, NodeActions())))

    def restore(self, node_id, held, grace=False):  # type: ignore[no-untyped-def]
        accepted, actions = self.index.restore(node_id, held)
        return Answered((accepted, actions.get(node_id, NodeActions())))

    def promoted(self, node_id: NodeId, done, failed, refused) -> None:  # type: ignore[no-untyped-def]
        self.index.promoted(node_id, done, failed, refused)

    def forget_shards(self, node_id: NodeId, shard_ids: list[ShardId]) -> None:
        self.index.forget_shards(shard_ids)

    def report_corrupt_after_hit(self, node_id: NodeId, shard_ids: list[ShardId]) -> None:
        self.index.report_corrupt_after_hit(shard_ids)

    def replicated(self, node_id: NodeId, done, failed) -> None:  # type: ignore[no-untyped-def]
        self.index.replicated(node_id, done, failed)


@dataclass
class Node:
    tier: ArenaTier
    core: NodeStoreCore
    arena: ArenaStore
    index: ChunkIndex
    worker: HolderLock
    other: HolderLock  # another worker of the node

    def job(self, n: int, seed: int, holder: HolderLock | None = None) -> list[ShardEntry]:
        """``n`` shards gathered into extents granted to ``holder`` (the worker)."""
        holder = holder or self.worker
        offsets = self.tier.grant(holder.holder, [SHARD] * n)
        rng = np.random.default_rng(seed)
        entries = []
        for i, offset in enumerate(offsets):
            assert offset is not None
            data = rng.integers(0, 256, SHARD, dtype=np.uint8)
            self.tier.region.view(offset, SHARD)[:] = data
            key = ChunkKey((seed * 100 + i).to_bytes(8, "big") + b"\0\0\0\1")
            entries.append(ShardEntry(key, offset, SHARD, digest(data), 0b1111))
        return entries

    def commit(self, *jobs: list[Any]) -> tuple[int, str, list[int | None], list[tuple[int, str]]]:
        return self.arena.commit(self.worker.holder, self.arena.epoch, NS, 0, 1, list(jobs))

    def books(self) -> dict[str, object]:
        """Every book a commit may change, but the refusal counter."""
        stats = dict(self.core.status()["stats"])  # type: ignore[call-overload]
        stats.pop("refused_commits")
        tier = self.tier
        return {
            "stats": stats,
            "used_bytes": tier.used_bytes,
            "shards": sorted(tier.items()),
            "holes": tier.allocator.holes(),
            "free_bytes": tier.allocator.free_bytes,
            "granted": copy.deepcopy(tier.holdings.granted),
            "pins": copy.deepcopy(tier.holdings.pins),
            # the directory and generations, byte for byte
            "tables": tier.region.array[tier.directory.extents_bytes :].tobytes(),
            "index": self.index.shards_on(NODE),
            "index_nodes": self.index.nodes(),
            "index_chunks": len(self.index),
            "index_stats": dict(vars(self.index.stats)),
        }

    def refused(self) -> int:
        return self.core.status()["stats"]["refused_commits"]  # type: ignore[index,no-any-return]


@pytest.fixture
def node() -> Iterator[Node]:
    region = ArenaRegion.create("ns-commits", uuid.uuid4().hex, 512 * KiB)
    tier = ArenaTier(region, capacity_bytes=256 * KiB)
    index = ChunkIndex()
    index.register_node(NODE, 256 * KiB, 0)
    core = NodeStoreCore(NODE, tier, None, IndexPort(index))
    worker, other = HolderLock(region.info.path), HolderLock(region.info.path)
    yield Node(tier, core, ArenaStore(core, tier), index, worker, other)
    worker.close()
    other.close()
    tier.close()


# ---- one malformed field, each: (what, how the job's second entry is spoiled) -------------
def _other_workers_extent(node: Node, entry: ShardEntry) -> Any:
    return entry._replace(offset=node.job(1, 90, node.other)[0].offset)


def _free_extent(node: Node, entry: ShardEntry) -> Any:
    return entry._replace(offset=node.tier.allocator.capacity - 2 * SHARD)


MALFORMED: dict[str, Callable[[Node, ShardEntry], Any]] = {
    "negative nbytes": lambda n, e: e._replace(nbytes=-1),
    "zero nbytes": lambda n, e: e._replace(nbytes=0),
    "nbytes past its extent": lambda n, e: e._replace(nbytes=SHARD + 1),
    "nbytes a string": lambda n, e: e._replace(nbytes="4096"),
    "digest of 65 bits": lambda n, e: e._replace(digest=1 << 64),
    "negative digest": lambda n, e: e._replace(digest=-1),
    "digest a float": lambda n, e: e._replace(digest=1.0),
    "digest a bool": lambda n, e: e._replace(digest=True),
    "offset outside the arena": lambda n, e: e._replace(offset=1 << 40),
    "negative offset": lambda n, e: e._replace(offset=-SHARD),
    "offset inside its extent": lambda n, e: e._replace(offset=e.offset + 64),
    "offset in the arena's tables": lambda n, e: e._replace(offset=n.tier.directory.extents_bytes),
    "offset granted to another worker": _other_workers_extent,
    "offset granted to nobody": _free_extent,
    "key too short": lambda n, e: e._replace(key=b"\0\0\0\1"),
    "key too long": lambda n, e: e._replace(key=b"k" * 100),
    "key a string": lambda n, e: e._replace(key="k" * 12),
    "group index out of range": lambda n, e: e._replace(
        key=b"k" * 8 + (1 << 20).to_bytes(4, "big")
    ),
    "key twice in the job": lambda n, e: e,  # replaced below: the first entry's key
    "extent twice in the job": lambda n, e: e,  # replaced below: the first entry's offset
    "negative slot mask": lambda n, e: e._replace(slot_mask=-1),
    "slot mask of 5000 bits": lambda n, e: e._replace(slot_mask=(1 << 5000) - 1),
    "parent of another length": lambda n, e: e._replace(parent=b"p" * 20),
    "parent a string": lambda n, e: e._replace(parent="p" * 12),
    "four fields": lambda n, e: tuple(e)[:4],
    "seven fields": lambda n, e: (*tuple(e), None),
    "not a tuple": lambda n, e: {"key": e.key},
    "None": lambda n, e: None,
}


def _spoiled(node: Node, what: str, job: list[ShardEntry]) -> list[Any]:
    first, second = job
    if what == "key twice in the job":
        return [first, second._replace(key=first.key)]
    if what == "extent twice in the job":
        return [first, second._replace(offset=first.offset)]
    return [first, MALFORMED[what](node, second)]


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_malformed_entry_refuses_its_job_and_changes_no_book(node: Node, what: str) -> None:
    job = node.job(2, 1)
    spoiled = _spoiled(node, what, job)
    before = node.books()

    kept, epoch, granted, refused = node.commit(spoiled)

    assert (kept, epoch, granted) == (0, node.arena.epoch, [None, None])
    [(index, why)] = refused
    assert index == 0 and "job[0][1]" in why, why  # names the entry and its field
    assert node.books() == before
    assert node.refused() == 1
    # The worker's extents are still its own: a good commit of the same job works.
    kept, _, granted, refused = node.commit(job)
    assert (kept, refused) == (2, [])
    assert {s.key for s, _ in node.tier.items()} == {e.key for e in job}
    assert {s.key for s, _ in node.index.shards_on(NODE)} == {e.key for e in job}
    assert node.tier.used_bytes == 2 * SHARD


def test_the_other_jobs_of_the_call_are_kept(node: Node) -> None:
    """One worker's call carries several store jobs: only the malformed one is refused."""
    first, bad, last = node.job(2, 1), node.job(2, 2), node.job(1, 3)
    bad[1] = bad[1]._replace(nbytes=-1)
    kept, _, granted, refused = node.commit(first, bad, last)
    assert kept == 3
    assert [i for i, _ in refused] == [1] and "nbytes = -1" in refused[0][1]
    assert granted[2:4] == [None, None] and None not in granted[:2] + granted[4:]
    stored = {e.key for e in first + last}
    assert {s.key for s, _ in node.tier.items()} == stored
    assert {s.key for s, _ in node.index.shards_on(NODE)} == stored
    assert node.core.status()["stats"]["stored_shards"] == 3  # type: ignore[index]
    # The refused job's extents are still granted (the worker gives them back).
    held = node.tier.holdings.granted[node.worker.holder]
    assert {e.offset for e in bad} <= set(held)
    assert node.refused() == 1


def test_an_extent_two_jobs_claim_is_kept_for_the_first_only(node: Node) -> None:
    first, second = node.job(1, 1), node.job(1, 2)
    second[0] = second[0]._replace(offset=first[0].offset)
    kept, _, _, refused = node.commit(first, second)
    assert kept == 1 and [i for i, _ in refused] == [1]
    assert [s.key for s, _ in node.tier.items()] == [first[0].key]


@pytest.mark.parametrize(
    ("holder", "namespace", "rank", "world_size", "jobs"),
    [
        ("not a holder id", NS, 0, 1, None),
        (None, NS, 0, 1, None),
        ("WORKER", "ab\n", 0, 1, None),  # a trailing newline: namespaces match in full
        ("WORKER", "", 0, 1, None),
        ("WORKER", NS, 1, 1, None),  # a rank outside its world
        ("WORKER", NS, -1, 1, None),
        ("WORKER", NS, 0, 0, None),
        ("WORKER", NS, 0, 1.0, None),
        ("WORKER", NS, 0, 1, "not a list"),
        ("WORKER", NS, 0, 1, [7]),
    ],
)
def test_a_malformed_call_is_refused_whole(
    node: Node, holder: Any, namespace: Any, rank: Any, world_size: Any, jobs: Any
) -> None:
    job = node.job(2, 1)
    holder = node.worker.holder if holder == "WORKER" else holder
    before = node.books()
    with pytest.raises(RefusedCommit):
        node.arena.commit(holder, node.arena.epoch, namespace, rank, world_size, jobs or [job])
    assert node.books() == before
    assert node.refused() == 1
    assert node.commit(job)[0] == 2


# ---- hypothesis: any malformed value of any field ------------------------------------------
_NOT_INT = st.one_of(st.floats(), st.text(max_size=4), st.none(), st.binary(max_size=4))
_BAD = {
    "key": st.one_of(
        st.binary(max_size=4),
        st.binary(min_size=69, max_size=90),
        st.text(max_size=12),
        st.integers(),
        st.binary(min_size=4, max_size=20).map(lambda b: b + b"\xff\xff\xff\xff"),
    ),
    "offset": st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=1, max_value=SHARD - 1),  # inside the worker's extent
        st.integers(min_value=512 * KiB, max_value=1 << 70),
        _NOT_INT,
        st.just(True),
    ),
    "nbytes": st.one_of(st.integers(max_value=0), st.integers(SHARD + 1, 1 << 70), _NOT_INT),
    "digest": st.one_of(st.integers(max_value=-1), st.integers(min_value=1 << 64), _NOT_INT),
    "slot_mask": st.one_of(st.integers(max_value=-1), st.just(1 << 4096), _NOT_INT),
    "parent": st.one_of(
        st.binary(max_size=11), st.binary(min_size=13, max_size=30), st.text(), st.integers()
    ),
}
_FIELD_AT = {name: i for i, name in enumerate(ShardEntry._fields)}


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), field=st.sampled_from(sorted(_BAD)))
def test_any_malformed_field_is_refused_and_changes_no_book(
    node: Node, data: st.DataObject, field: str
) -> None:
    job = node.job(2, data.draw(st.integers(0, 1 << 20)))
    value = data.draw(_BAD[field], label=field)
    spoiled = list(job[1])
    spoiled[_FIELD_AT[field]] = value
    refusals = node.refused()
    before = node.books()
    kept, _, granted, refused = node.commit([job[0], tuple(spoiled)])
    assert (kept, granted, [i for i, _ in refused]) == (0, [None, None], [0])
    assert f"job[0][1].{field}" in refused[0][1]
    assert node.books() == before
    assert node.refused() == refusals + 1
    node.tier.give_back(node.worker.holder, [e.offset for e in job])  # as the worker does


# ---- the object path: a job buffer ---------------------------------------------------------
@pytest.mark.parametrize(
    "spoil",
    [
        lambda e: e._replace(nbytes=-1),
        lambda e: e._replace(digest=1 << 64),
        lambda e: e._replace(offset=SHARD + 64),  # runs past the buffer's end
        lambda e: e._replace(key=b"short"[:3]),
        lambda e: e._replace(slot_mask=-5),
    ],
    ids=["negative nbytes", "digest of 65 bits", "outside the buffer", "short key", "slots"],
)
def test_a_malformed_store_through_the_object_store_is_refused(
    node: Node, spoil: Callable[[ShardEntry], Any]
) -> None:
    data = np.random.default_rng(5).integers(0, 256, 2 * SHARD, dtype=np.uint8)
    keys = [ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\2") for i in range(2)]
    entries = [
        ShardEntry(k, i * SHARD, SHARD, digest(data[i * SHARD : (i + 1) * SHARD]), 1)
        for i, k in enumerate(keys)
    ]
    before = node.books()
    with pytest.raises(RefusedCommit, match=r"entry|job\[1\]"):
        node.core.store(NS, 0, 1, [entries[0], spoil(entries[1])], data)
    assert node.books() == before
    assert node.refused() == 1
    assert node.core.store(NS, 0, 1, entries, data) == 2
    assert {s.key for s, t in node.index.shards_on(NODE) if t is TierName.CPU} == set(keys)
