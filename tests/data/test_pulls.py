"""A node's lookup-time pulls (tierstore.store.pulls), without Ray: one pull per holder,
a shard asked for again while in flight (or once held) is not pulled again, a load that
comes before the Evictor's pull message starts the pull and the message joins it, a
load's join waits for the pull (bounded), a failed pull fails whoever joined it, and a
pull still queued fails nobody."""

from __future__ import annotations

import threading
import time

from tests.support import wait_for
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId
from tierstore.store.pulls import Moved, Pulls
from tierstore.store.replicas import Landed
from tierstore.wire import PullState

NS = Namespace("ab")
A, C = NodeId("node-a"), NodeId("node-c")


def sid(i: int, rank: int = 0) -> ShardId:
    return ShardId(NS, ChunkKey(bytes([i]) * 12), rank)


class Holders:
    """Fake holders: each fetch is recorded, and waits until ``release`` is set."""

    def __init__(self, fail: set[NodeId] | None = None) -> None:
        self.fetches: list[tuple[NodeId, list[ShardId]]] = []
        self.release = threading.Event()
        self.fail = fail or set()
        self.held: set[ShardId] = set()
        self.failed: list[ShardId] = []

    def move(self, holder: NodeId, ids: list[ShardId]) -> Moved:
        self.fetches.append((holder, list(ids)))
        assert self.release.wait(10)
        if holder in self.fail:
            raise ConnectionError(f"{holder} died")
        self.held.update(ids)
        return Moved(8 * len(ids), 0.0, Landed(list(ids), []))

    def report(self, landed: Landed) -> None:
        self.failed.extend(landed.failed)

    def pulls(self, workers: int = 4) -> Pulls:
        return Pulls(self.move, self.report, self.held.__contains__, workers)


def test_one_pull_per_holder_and_none_again_while_in_flight() -> None:
    holders = Holders()
    pulls = holders.pulls()
    # A request's chunks: two ranks' shards on A, one on C.
    assert pulls.start([(sid(0, 0), A), (sid(0, 1), A), (sid(1, 0), C)]) == 2
    # A second request asks for a shard being pulled, and one more: only the new one.
    assert pulls.start([(sid(0, 0), A), (sid(2, 0), A)]) == 1
    holders.release.set()
    states = pulls.wait([sid(0, 0), sid(0, 1), sid(1, 0), sid(2, 0)], 10)
    assert states == [PullState.HELD] * 4
    assert sorted((h, sorted(ids)) for h, ids in holders.fetches) == sorted(
        [(A, [sid(0, 0), sid(0, 1)]), (C, [sid(1, 0)]), (A, [sid(2, 0)])]
    )
    assert pulls.status()["joined"] == 1 and pulls.status()["in_flight"] == 0
    assert pulls.wait([sid(9)], 10) == [PullState.NONE]  # never pulled: the load pulls it


def test_a_join_waits_for_the_pull_at_most_its_deadline_and_a_failed_pull_fails_it() -> None:
    holders = Holders(fail={A})
    pulls = holders.pulls(workers=1)
    pulls.start([(sid(0), A)])
    started = time.monotonic()
    assert pulls.wait([sid(0)], 0.2) == [PullState.FAILED]  # still running at the deadline
    assert 0.2 <= time.monotonic() - started < 2
    holders.release.set()
    # Reported (after the loads go on): the Evictor gives the room back.
    wait_for(lambda: holders.failed == [sid(0)], "the failed pull reported", 10)
    assert pulls.status()["failed"] == 1
    # A load after the failure joins nothing: it reads the chunk from a holder itself.
    assert pulls.wait([sid(0)], 10) == [PullState.NONE]


def test_a_pull_queued_behind_a_slow_holder_fails_no_load_from_another_holder() -> None:
    holders = Holders()
    pulls = holders.pulls(workers=1)
    pulls.start([(sid(0), A)])  # A hangs: it holds the only pull thread
    while not holders.fetches:
        time.sleep(0.01)
    pulls.start([(sid(1), C)])  # queued behind A's
    started = time.monotonic()
    # The load of C's shard does not wait on (or fail with) the queue: it reads from C.
    assert pulls.wait([sid(1)], 5) == [PullState.NONE]
    assert time.monotonic() - started < 1
    # A's own shard is joined: its pull runs.
    assert pulls.wait([sid(0)], 0.1) == [PullState.FAILED]
    holders.release.set()
    assert pulls.wait([sid(0)], 10) == [PullState.HELD]


def test_a_load_before_the_pull_message_starts_the_pull_and_the_message_joins_it() -> None:
    holders = Holders()
    pulls = holders.pulls()
    holders.release.set()
    # The load names each shard's holder: nothing is in flight, so it starts the pulls,
    # one per holder, and waits for them.
    asked = [sid(0, 0), sid(0, 1), sid(1, 0)]
    assert pulls.wait(asked, 10, [A, A, C]) == [PullState.HELD] * 3
    assert sorted((h, sorted(ids)) for h, ids in holders.fetches) == sorted(
        [(A, [sid(0, 0), sid(0, 1)]), (C, [sid(1, 0)])]
    )
    # The Evictor's message for the same shards comes second: they are held, no pull.
    assert pulls.start([(sid(0, 0), A), (sid(0, 1), A), (sid(1, 0), C)]) == 0
    assert len(holders.fetches) == 2
    status = pulls.status()
    assert status["pulls"] == 2 and status["started_by_loads"] == 2 and status["joined"] == 3


def test_a_load_after_the_pull_message_joins_its_pull_and_starts_none() -> None:
    holders = Holders()
    pulls = holders.pulls()
    pulls.start([(sid(0), A)])  # the Evictor's message came first
    holders.release.set()
    assert pulls.wait([sid(0)], 10, [A]) == [PullState.HELD]
    assert holders.fetches == [(A, [sid(0)])]
    assert pulls.status()["started_by_loads"] == 0


def test_a_failed_pull_the_load_started_leaves_the_load_to_read_the_shard_itself() -> None:
    holders = Holders(fail={A})
    pulls = holders.pulls()
    holders.release.set()
    # Its own pull failed: NONE, so the load reads from the holder (or another copy the
    # Evictor names) as it would with no pull, rather than failing.
    assert pulls.wait([sid(0)], 10, [A]) == [PullState.NONE]
    wait_for(lambda: holders.failed == [sid(0)], "the failed pull reported", 10)
    assert pulls.status()["failed"] == 1
    # A pull the Evictor's message started that fails still fails the load joining it.
    holders.release.clear()
    pulls.start([(sid(1), A)])
    while not any(sid(1) in ids for _, ids in holders.fetches):
        time.sleep(0.01)
    threading.Timer(0.2, holders.release.set).start()
    assert pulls.wait([sid(1)], 10, [A]) == [PullState.FAILED]


def test_loads_waiting_on_a_pull_go_on_before_its_reports_are_sent() -> None:
    """A pull's one-way reports (to the Evictor which shards it kept, to the holder that
    its loan ended) are sent after the loads joined to it are released: a slow send
    costs them nothing."""
    held: set[ShardId] = set()
    ended: list[NodeId] = []
    sends = threading.Event()

    def move(holder: NodeId, ids: list[ShardId]) -> Moved:
        held.update(ids)
        return Moved(8, 0.0, Landed(list(ids), []), end_loan=lambda: ended.append(holder))

    reported: list[Landed] = []

    def report(landed: Landed) -> None:
        assert sends.wait(10)  # a send that takes until the load has gone on
        reported.append(landed)

    pulls = Pulls(move, report, held.__contains__, 2)
    pulls.start([(sid(0), A)])
    started = time.monotonic()
    assert pulls.wait([sid(0)], 5) == [PullState.HELD]
    assert time.monotonic() - started < 4  # not held back until the join's deadline
    assert not reported and not ended
    sends.set()
    wait_for(lambda: reported == [Landed([sid(0)], [])] and ended == [A], "the reports", 10)
