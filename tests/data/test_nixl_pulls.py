"""Pulls over NIXL between two nodes' arenas (tierstore.store.nixl_pulls), without Ray:
two real NodeStore cores, each with a real arena file and its own NIXL agent (UCX), in
this process. A read lands the holder's bytes exactly in the puller's arena and they are
kept only if they verify; a read that cannot finish by its deadline keeps nothing and
its extents stay out of use until their quarantine ends; a loan keeps the holder's
extents pinned (a shard dropped meanwhile is not reused under the read) until the puller
ends it, or until its time is up."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np
import pytest

from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.region import ArenaRegion
from tierstore.data.checksum import digest
from tierstore.data.tiers.arena import ArenaTier
from tierstore.data.tiers.base import StoredShard
from tierstore.errors import ChunkNotFoundError
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId
from tierstore.store.loans import ArenaLoans
from tierstore.store.nixl_pulls import NixlArena, check_nixl
from tierstore.store.node_store import NodeStoreCore
from tierstore.store.replicas import Landed
from tierstore.wire import ShardMeta
from tierstore.wire_nixl import NixlLoan

pytest.importorskip("nixl._api", reason="NIXL is installed by deploy/setup.sh")

NS = Namespace("ab12")
SHARD = 64 << 10
TIMEOUT_S = 2.0


@dataclass
class Reports:
    """The Evictor port: what the node reported of replicas and corrupt copies."""

    done: list[ShardId] = field(default_factory=list)
    failed: list[ShardId] = field(default_factory=list)
    corrupt: list[ShardId] = field(default_factory=list)

    def replicated(self, node_id: NodeId, done: list[ShardId], failed: list[ShardId]) -> None:
        self.done += done
        self.failed += failed

    def report_corrupt_after_hit(self, node_id: NodeId, shard_ids: list[ShardId]) -> None:
        self.corrupt += shard_ids


@dataclass
class Node:
    core: NodeStoreCore
    tier: ArenaTier
    nixl: NixlArena
    reports: Reports


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node]]:
    made: list[tuple[ArenaRegion, HolderLock, NixlArena]] = []

    def node(quarantine_s: float) -> Node:
        region = ArenaRegion.create("ns-nixl", uuid.uuid4().hex, 4 << 20)
        tier = ArenaTier(region, capacity_bytes=2 << 20)
        reports = Reports()
        core = NodeStoreCore(NodeId(uuid.uuid4().hex), tier, None, reports)  # type: ignore[arg-type]
        lock = HolderLock(region.info.path)
        loans = ArenaLoans(core, tier, lock.holder, quarantine_s)
        nixl = NixlArena(loans, region.array, core.node_id, TIMEOUT_S)
        made.append((region, lock, nixl))
        return Node(core, tier, nixl, reports)

    yield node(quarantine_s=TIMEOUT_S), node(quarantine_s=0.5)
    for region, lock, nixl in made:
        nixl.close()
        lock.close()
        region.close()


def _hold(node: Node, n: int, seed: int) -> list[tuple[ShardId, ShardMeta, np.ndarray]]:
    """``n`` shards of random bytes held in ``node``'s CPU tier."""
    rng = np.random.default_rng(seed)
    held = []
    for i in range(n):
        data = rng.integers(0, 255, SHARD - 64 * i, dtype=np.uint8)  # sizes differ
        shard_id = ShardId(NS, ChunkKey(bytes([seed, i]) + b"\0" * 10), 0)
        meta = ShardMeta(data.nbytes, digest(data), 1)
        node.tier.put(shard_id, StoredShard(meta, data))
        held.append((shard_id, meta, data))
    return held


def _lend(
    holder: Node, held: list[tuple[ShardId, ShardMeta, np.ndarray]]
) -> tuple[NixlLoan, list[tuple[ShardId, ShardMeta]]]:
    """The holder lends ``held``: the loan, and each shard with the meta it answered."""
    loan, metas = holder.nixl.lend([s for s, _, _ in held])
    assert metas == [m for _, m, _ in held]
    return loan, list(zip([s for s, _, _ in held], metas, strict=True))


def test_a_read_lands_the_holders_bytes_exactly_and_keeps_them_as_replicas(
    nodes: tuple[Node, Node],
) -> None:
    holder, puller = nodes
    held = _hold(holder, 5, seed=1)
    loan, shards = _lend(holder, held)
    assert holder.tier.status()["pinned_extents"] == 5  # lent: pinned until ended
    moved = puller.nixl.read(loan, shards, time.perf_counter())
    assert moved.nbytes == sum(m.nbytes for _, m in shards)
    for shard_id, _, data in held:
        kept = puller.tier.find(shard_id)
        assert kept is not None and np.array_equal(kept.data, data)
    assert moved.landed.kept == [s for s, _, _ in held] and not moved.landed.failed
    holder.nixl.end_loan(loan.loan_id)
    assert holder.tier.status()["pinned_extents"] == 0
    assert puller.nixl.status()["read_in_place"] == 5
    assert holder.nixl.status()["lent_in_place"] == 5


def test_bytes_that_changed_under_the_loan_are_not_kept(nodes: tuple[Node, Node]) -> None:
    """The holder's memory changed after the lend (the meta's digest is the stored
    bytes'): the puller reads other bytes, which fail their checksum: not kept,
    reported failed, and the extent given back."""
    holder, puller = nodes
    (good, bad) = _hold(holder, 2, seed=2)
    loan, metas = holder.nixl.lend([good[0], bad[0]])
    view = holder.tier.find(bad[0])
    assert view is not None
    view.data[:8] ^= 0xFF
    free_before = puller.tier.status()["arena_free_bytes"]
    moved = puller.nixl.read(loan, [(good[0], metas[0]), (bad[0], metas[1])], time.perf_counter())
    assert puller.tier.find(bad[0]) is None and puller.tier.find(good[0]) is not None
    assert moved.landed == Landed([good[0]], [bad[0]])
    assert puller.tier.status()["arena_free_bytes"] == free_before - good[1].nbytes


def test_a_read_past_its_deadline_keeps_nothing_and_quarantines_its_extents(
    nodes: tuple[Node, Node],
) -> None:
    holder, puller = nodes
    loan, shards = _lend(holder, _hold(holder, 2, seed=3))
    free_before = puller.tier.status()["arena_free_bytes"]
    with pytest.raises(TimeoutError):  # its pull started longer ago than its deadline
        puller.nixl.read(loan, shards, time.perf_counter() - 2 * TIMEOUT_S)
    assert all(puller.tier.find(s) is None for s, _ in shards)
    # The read may still land: its extents are not free before the quarantine ends.
    assert puller.tier.status()["arena_free_bytes"] < free_before
    assert puller.nixl.status()["quarantined_extents"] == 2
    time.sleep(0.5 + 0.3)  # the puller's quarantine, then its reaper's round
    assert puller.tier.status()["arena_free_bytes"] == free_before
    assert puller.nixl.status()["quarantined_extents"] == 0


def test_a_loan_pins_a_dropped_shards_extent_until_it_ends_or_its_time_is_up(
    nodes: tuple[Node, Node],
) -> None:
    holder, _ = nodes
    ((shard_id, meta, _),) = _hold(holder, 1, seed=4)
    holder.nixl.lend([shard_id])
    free_before = holder.tier.status()["arena_free_bytes"]
    holder.tier.delete(shard_id)  # the Evictor dropped it while lent
    assert holder.tier.find(shard_id) is None
    assert holder.tier.status()["arena_free_bytes"] == free_before  # not reused yet
    # Never ended by its puller: it ends when its time is up.
    deadline = time.monotonic() + TIMEOUT_S + 1.0
    while holder.tier.status()["pinned_extents"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert holder.tier.status()["pinned_extents"] == 0
    assert holder.tier.status()["arena_free_bytes"] == free_before + meta.nbytes
    assert holder.nixl.status()["loans_overdue"] == 1


def test_a_shard_not_in_memory_is_not_lent(nodes: tuple[Node, Node]) -> None:
    holder, _ = nodes
    (held,) = _hold(holder, 1, seed=5)
    missing = ShardId(NS, ChunkKey(b"\xee" * 12), 0)
    with pytest.raises(ChunkNotFoundError):
        holder.nixl.lend([held[0], missing])
    assert holder.tier.status()["pinned_extents"] == 0  # nothing left pinned


def test_check_nixl_passes_where_it_is_installed() -> None:
    check_nixl()


def test_an_idle_agent_does_not_keep_a_core_busy(nodes: tuple[Node, Node]) -> None:
    """nixl's Python agent would spin its progress thread (a core per agent, each
    NodeStore's); tierstore's agents pause between rounds. Both agents of the fixture,
    idle for a second, take a small part of one core (spinning: about two cores)."""
    started = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - started < 0.5


def _lend_then_wait(conn: Connection) -> None:
    """A holder process: holds three shards, lends them, sends the loan and the shards'
    ids and metas, then waits to be killed."""
    region = ArenaRegion.create("ns-nixl", uuid.uuid4().hex, 4 << 20)
    tier = ArenaTier(region, capacity_bytes=2 << 20)
    core = NodeStoreCore(NodeId(uuid.uuid4().hex), tier, None, Reports())  # type: ignore[arg-type]
    lock = HolderLock(region.info.path)
    holder = Node(
        core,
        tier,
        NixlArena(ArenaLoans(core, tier, lock.holder, 1.0), region.array, core.node_id, 60.0),
        Reports(),
    )
    conn.send(_lend(holder, _hold(holder, 3, seed=6)))
    time.sleep(60)


def test_a_holder_killed_mid_pull_fails_the_read_within_its_deadline(
    nodes: tuple[Node, Node],
) -> None:
    """The holder's process lent its extents and died before the puller read them: the
    read fails by its deadline, nothing is kept, and the reserved extents are
    quarantined (the read might still land)."""
    _, puller = nodes
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    process = spawn.Process(target=_lend_then_wait, args=(theirs,), daemon=True)
    process.start()
    try:
        assert ours.poll(60), "the holder process did not lend"
        loan, shards = ours.recv()
    finally:
        process.kill()
        process.join(10)
    started = time.perf_counter()
    with pytest.raises((ConnectionError, TimeoutError)):
        puller.nixl.read(loan, shards, started)
    assert time.perf_counter() - started < TIMEOUT_S + 1.0
    assert all(puller.tier.find(s) is None for s, _ in shards)
    assert puller.nixl.status()["quarantined_extents"] == 3
