"""A TP group's ranks commit the same chunks in separate calls; the NodeStore gathers
them, so each token boundary is one admission at the Evictor (issue 28), and nothing is
lost when a rank is late or never comes.

A real arena and a real ChunkIndex in process (the Evictor port of
tests/data/test_malformed_commits.py), two workers' holder locks as the two ranks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from tests.data.test_malformed_commits import NODE, NS, SHARD, IndexPort, KiB
from tierstore.control.index import ChunkIndex, LookupState
from tierstore.data.arena.holders import HolderLock
from tierstore.data.arena.region import ArenaRegion
from tierstore.data.checksum import digest
from tierstore.data.tiers.arena import ArenaTier
from tierstore.errors import UnknownNodeError
from tierstore.keys import ChunkKey
from tierstore.store.arena_store import ArenaStore
from tierstore.store.node_store import NodeStoreCore
from tierstore.store.rank_gather import GATHER_WAIT_S, RankGather
from tierstore.wire import ShardEntry

GROUPS = 3
BOUNDARIES = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TwoRanks:
    def __init__(self) -> None:
        self.region = ArenaRegion.create("ns-gather", uuid.uuid4().hex, 512 * KiB)
        self.tier = ArenaTier(self.region, capacity_bytes=256 * KiB)
        self.index = ChunkIndex()
        self.index.register_node(NODE, 256 * KiB, 0)
        self.core = NodeStoreCore(NODE, self.tier, None, IndexPort(self.index))
        self.clock = Clock()
        self.gather = RankGather(clock=self.clock)
        self.arena = ArenaStore(self.core, self.tier, self.gather)
        self.ranks = [HolderLock(self.region.info.path) for _ in range(2)]
        self.keys = [
            ChunkKey((b + 1).to_bytes(8, "big") + g.to_bytes(4, "big"))
            for b in range(BOUNDARIES)
            for g in range(GROUPS)
        ]

    def data(self, rank: int, i: int) -> np.ndarray:
        return np.random.default_rng(rank * 1000 + i).integers(0, 256, SHARD, dtype=np.uint8)

    def commit(self, rank: int, keys: list[ChunkKey]) -> int:
        holder = self.ranks[rank].holder
        offsets = self.tier.grant(holder, [SHARD] * len(keys))
        entries = []
        for key, offset in zip(keys, offsets, strict=True):
            assert offset is not None
            data = self.data(rank, self.keys.index(key))
            self.tier.region.view(offset, SHARD)[:] = data
            entries.append(ShardEntry(key, offset, SHARD, digest(data), 1))
        kept, _, _, refused = self.arena.commit(holder, self.arena.epoch, NS, rank, 2, [entries])
        assert not refused
        return kept

    def states(self, keys: list[ChunkKey]) -> list[LookupState]:
        answers, _ = self.index.lookup(NS, keys, "t", self.clock.now, 5.0)
        return [a.state for a in answers]

    def loads(self, keys: list[ChunkKey]) -> None:
        """Every rank's bytes of ``keys``, as that rank stored them."""
        for rank in (0, 1):
            data, _ = self.core.load(NS, rank, keys)
            want = b"".join(bytes(self.data(rank, self.keys.index(k))) for k in keys)
            assert bytes(data) == want

    def close(self) -> None:
        for lock in self.ranks:
            lock.close()
        self.tier.close()


@pytest.fixture
def tp() -> Iterator[TwoRanks]:
    node = TwoRanks()
    yield node
    node.close()


def test_two_ranks_commits_of_the_same_chunks_are_one_admission_per_boundary(
    tp: TwoRanks,
) -> None:
    assert tp.commit(0, tp.keys) == 0  # parked: rank 1's shards are not here yet
    assert tp.index.stats.admit_calls == 0 and tp.states(tp.keys[:1]) == [LookupState.MISS]
    assert tp.commit(1, tp.keys) == 2 * len(tp.keys)  # both ranks, adopted now
    assert tp.index.stats.admit_calls == 1
    assert tp.index.stats.admitted_units == BOUNDARIES  # not boundaries x groups x ranks
    assert tp.states(tp.keys) == [LookupState.HIT] * len(tp.keys)
    tp.loads(tp.keys)
    assert len(tp.gather) == 0


def test_a_late_rank_completes_a_unit_admitted_without_it(tp: TwoRanks) -> None:
    """Rank 1 commits only the first boundary in time; the rest of rank 0's commit is
    admitted partial once it waited, and rank 1's late commit completes it."""
    first = tp.keys[:GROUPS]
    tp.commit(0, tp.keys)
    tp.commit(1, first)
    assert tp.states(tp.keys) == [LookupState.HIT] * GROUPS + [LookupState.MISS] * (
        len(tp.keys) - GROUPS
    )
    tp.clock.now += GATHER_WAIT_S
    assert tp.commit(1, []) == len(tp.keys) - GROUPS  # the next commit: rank 0's, partial
    assert tp.states(tp.keys[GROUPS:]) == [LookupState.MISS] * (len(tp.keys) - GROUPS)
    assert tp.commit(1, tp.keys[GROUPS:]) == len(tp.keys) - GROUPS  # completes them at once
    assert tp.states(tp.keys) == [LookupState.HIT] * len(tp.keys)
    tp.loads(tp.keys)
    assert len(tp.gather) == 0 and tp.core.status()["stats"]["stored_shards"] == 2 * len(tp.keys)


def test_shards_gathered_for_a_failed_admission_are_offered_with_the_retry(
    tp: TwoRanks,
) -> None:
    """The Evictor lost this node (it restarted) as the last rank came: the commit fails,
    and the gathered shards of both ranks go with the actor's retry, none lost."""
    tp.commit(0, tp.keys)
    tp.index.forget_node(NODE)
    with pytest.raises(UnknownNodeError):
        tp.commit(1, tp.keys)
    tp.index.register_node(NODE, 256 * KiB, 0)
    assert tp.commit(1, tp.keys) == 2 * len(tp.keys)  # the retry: its shards again
    assert tp.states(tp.keys) == [LookupState.HIT] * len(tp.keys)
    tp.loads(tp.keys)


def test_a_flush_offers_what_no_commit_completes_once_it_waited(tp: TwoRanks) -> None:
    """No other commit comes (the last request before a pause; rank 1 never stores):
    the actor's flusher offers rank 0's shards once they waited, not before."""
    tp.commit(0, tp.keys)
    assert tp.arena.flush_gathered() == 0 and tp.arena.gathered == len(tp.keys)
    tp.clock.now += GATHER_WAIT_S
    assert tp.arena.flush_gathered() == len(tp.keys) and tp.arena.gathered == 0
    assert {s.key for s, _ in tp.index.shards_on(NODE)} == set(tp.keys)
    assert tp.states(tp.keys) == [LookupState.MISS] * len(tp.keys)  # rank 1 never came
    data, _ = tp.core.load(NS, 0, tp.keys)
    assert bytes(data) == b"".join(bytes(tp.data(0, i)) for i in range(len(tp.keys)))


def test_a_failed_admission_parks_the_other_ranks_and_never_adopts_given_back_extents(
    tp: TwoRanks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admission times out as rank 1 commits: its worker gives its extents back (and
    may refill them), so only rank 0's gathered shards stay parked; flushed later, rank
    0's shards are held with their own bytes and nothing of rank 1's is adopted."""
    tp.commit(0, tp.keys)
    port = tp.core.evictor

    def unreachable(*args: object) -> None:
        raise TimeoutError("the Evictor did not answer")

    monkeypatch.setattr(port, "admit_units", unreachable)
    granted_before = dict(tp.tier.holdings.granted.get(tp.ranks[1].holder, {}))
    with pytest.raises(TimeoutError):
        tp.commit(1, tp.keys)
    monkeypatch.undo()
    rank1 = tp.tier.holdings.granted[tp.ranks[1].holder]
    tp.tier.give_back(tp.ranks[1].holder, [o for o in rank1 if o not in granted_before])
    assert tp.arena.gathered == len(tp.keys)  # rank 0's only
    tp.clock.now += GATHER_WAIT_S
    assert tp.arena.flush_gathered() == len(tp.keys)
    assert {(s.key, s.rank) for s, _ in tp.index.shards_on(NODE)} == {(k, 0) for k in tp.keys}
    data, _ = tp.core.load(NS, 0, tp.keys)
    assert bytes(data) == b"".join(bytes(tp.data(0, i)) for i in range(len(tp.keys)))
