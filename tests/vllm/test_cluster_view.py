"""The scheduler's cluster view (its presence snapshot): built from the Evictor's index,
kept by events, trusted only while fresh, dropped on any gap in the chain (the log
wrapped, the Evictor restarted).

The Evictor channel here is a manual one (polls wait until the test answers them); the
real channel and Evictor are covered in ``test_manager.py``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tierstore.control.events import EventBatch, ResidencyEvent
from tierstore.keys import ChunkKey, Namespace, NodeId, TierName
from tierstore.vllm.cluster_view import STATUS_PERIOD_S, ClusterView, Presence
from tierstore.vllm.metrics import (
    CLUSTER,
    TIER_CAPACITY,
    TIER_CHUNKS,
    TIER_USED,
    ManagerMetrics,
)

NS = Namespace("view-test")
A, B = NodeId("node-a"), NodeId("node-b")
CPU, DISK = TierName.CPU, TierName.DISK
AGE_S = 0.2


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\0")


def event(node: NodeId, tier: TierName, removed: bool, *keys: int) -> ResidencyEvent:
    return ResidencyEvent(0, NS, node, tier, removed, [key(i) for i in keys])


class ManualChannel:
    """Records each poll (to ``shards`` Evictor shards); the test answers it (as the
    shard's channel thread would)."""

    def __init__(self, shards: int = 1) -> None:
        self.shards = shards
        self.polls: list[tuple[str, int, Callable[[Any], None]]] = []

    def poll(
        self,
        call: Callable[[Any], Any],
        on_done: Callable[[Any], None],
        what: str,
        shard: int = 0,
    ) -> None:
        self.polls.append((what, shard, on_done))

    def sibling(self) -> ManualChannel:
        return self

    def answer(self, what: str, value: Any, shard: int = 0) -> None:
        (i,) = [i for i, (w, s, _) in enumerate(self.polls) if w == what and s == shard]
        self.polls.pop(i)[2](value)


def _in_memory(view: ClusterView, k: ChunkKey, now: float, node: NodeId) -> NodeId | None:
    """Where the snapshot alone says ``k`` is loadable from (nothing stored here lately)."""
    return view.loadable_from(k, now, node, stored_here_lately=False)


def _view(shards: int = 1) -> tuple[ClusterView, ManualChannel]:
    channel = ManualChannel(shards)
    view = ClusterView(channel, NS, threading.RLock(), ManagerMetrics(), None, AGE_S)  # type: ignore[arg-type]
    return view, channel


def test_presence_counts_each_copy_once_and_forgets_a_key_with_none_left() -> None:
    presence = Presence()
    presence.apply([event(A, CPU, False, 1, 2), event(A, CPU, False, 1), event(A, DISK, False, 1)])
    presence.apply([event(A, CPU, True, 1, 2)])  # 1 is still on A's disk
    assert key(1) in presence and key(2) not in presence
    presence.apply([event(B, CPU, False, 1), event(A, DISK, True, 1)])
    assert key(1) in presence
    presence.apply([event(B, CPU, True, 1), event(B, CPU, True, 7)])
    assert len(presence) == 0


def test_absent_only_with_a_fresh_snapshot() -> None:
    view, channel = _view()
    assert not view.absent(key(1), 0.0)  # no snapshot yet: ask
    view.maybe_poll(0.0)
    channel.answer("events", EventBatch(5, 0, [event(A, CPU, False, 1)], "e1"))
    assert view.absent(key(2), 0.1) and not view.absent(key(1), 0.1)
    assert not view.absent(key(2), AGE_S + 0.01)  # stale: ask
    view.maybe_poll(0.15)  # events since 5
    channel.answer("events", EventBatch(6, 0, [event(B, CPU, False, 2)], "e1"))
    assert not view.absent(key(2), 0.2) and view.absent(key(3), 0.3)


def test_a_copy_in_memory_is_found_on_the_asking_node_first() -> None:
    view, channel = _view()
    assert _in_memory(view, key(1), 0.0, A) is None  # no snapshot yet
    view.maybe_poll(0.0)
    batch = [
        event(A, DISK, False, 1, 2),
        event(B, CPU, False, 1, 3),
        event(A, CPU, False, 3),
        event(B, DISK, False, 2, 4),
    ]
    channel.answer("events", EventBatch(4, 0, batch, "e1"))
    assert _in_memory(view, key(1), 0.1, A) == B  # memory elsewhere, not A's disk
    assert _in_memory(view, key(2), 0.1, A) is None  # on disk only: asked
    assert _in_memory(view, key(3), 0.1, A) == A and _in_memory(view, key(3), 0.1, B) == B
    assert _in_memory(view, key(9), 0.1, A) is None
    assert _in_memory(view, key(3), AGE_S + 0.01, A) is None  # stale: asked
    view.maybe_poll(0.15)
    channel.answer("events", EventBatch(5, 0, [event(B, CPU, True, 1)], "e1"))
    assert _in_memory(view, key(1), 0.2, A) is None


def test_a_chunk_stored_here_lately_loads_from_here_unless_the_snapshot_knows_it() -> None:
    """This engine's fresh store, not in the snapshot (committed after the poll) or with no
    fresh snapshot at all: this node. One the snapshot knows goes by the snapshot."""
    view, channel = _view()
    assert view.loadable_from(key(1), 0.0, A, stored_here_lately=True) == A  # no snapshot
    view.maybe_poll(0.0)
    channel.answer("events", EventBatch(2, 0, [event(B, DISK, False, 2)], "e1"))
    assert view.loadable_from(key(1), 0.1, A, stored_here_lately=True) == A
    assert view.loadable_from(key(2), 0.1, A, stored_here_lately=True) is None  # disk only
    assert view.loadable_from(key(1), AGE_S + 0.01, A, stored_here_lately=True) == A


def test_a_failed_poll_leaves_the_snapshot_to_age_out() -> None:
    view, channel = _view()
    view.maybe_poll(0.0)
    channel.answer("events", EventBatch(0, 0, [], "e1"))
    view.maybe_poll(0.15)
    channel.answer("events", None)
    assert view.absent(key(1), 0.19) and not view.absent(key(1), 0.21)


def test_a_gap_in_the_log_drops_the_snapshot_until_a_new_one() -> None:
    for gap in (EventBatch(9, 3, [], "e1"), EventBatch(2, 0, [], "restarted")):
        view, channel = _view()
        view.maybe_poll(0.0)
        channel.answer("events", EventBatch(5, 0, [], "e1"))
        assert view.absent(key(1), 0.05)
        view.maybe_poll(0.15)
        channel.answer("events", gap)
        assert not view.absent(key(1), 0.16)  # every key is asked meanwhile
        view.maybe_poll(0.3)  # a snapshot again
        channel.answer("events", EventBatch(2, 0, [event(A, CPU, False, 1)], gap.epoch))
        assert view.absent(key(2), 0.31) and not view.absent(key(1), 0.31)


def test_a_cache_reset_drops_the_snapshot_and_any_one_asked_before_it() -> None:
    """A reset forgets the chunks this engine just stored; a snapshot polled before their
    commits landed would answer them MISS, so it goes, and so does one still in flight."""
    view, channel = _view()
    view.maybe_poll(0.0)
    channel.answer("events", EventBatch(5, 0, [], "e1"))
    assert view.absent(key(1), 0.05)
    view.drop(0.06)
    assert not view.absent(key(1), 0.07) and _in_memory(view, key(1), 0.07, A) is None
    view.maybe_poll(0.1)  # a snapshot, answered after the next reset
    view.drop(0.12)
    channel.answer("events", EventBatch(6, 0, [], "e1"))
    assert not view.absent(key(1), 0.13)
    view.maybe_poll(0.2)
    channel.answer("events", EventBatch(7, 0, [event(A, CPU, False, 1)], "e1"))
    assert view.absent(key(2), 0.21) and _in_memory(view, key(1), 0.21, A) == A


def test_presence_tells_seven_nodes_apart_and_lumps_the_rest_without_naming_them() -> None:
    """The eighth node on, a tier's copies share one bit: they keep a key held (asked, never
    a MISS at once, even after one of them goes) and never name a node to load from. This
    engine's own node is always told apart, whatever order the nodes come in."""
    here = NodeId("here")
    presence = Presence(local=here)
    nodes = [NodeId(f"node-{i}") for i in range(9)]
    presence.apply([event(n, CPU, False, i) for i, n in enumerate(nodes)])
    presence.apply([event(here, CPU, False, 100), event(nodes[8], CPU, False, 100)])
    assert [presence.in_memory(key(i), None) for i in range(6)] == nodes[:6]
    assert [presence.in_memory(key(i), None) for i in (6, 7, 8)] == [None] * 3  # lumped
    assert all(key(i) in presence for i in range(9))
    assert presence.in_memory(key(100), nodes[8]) == here  # not the lumped node
    presence.apply([event(nodes[8], CPU, True, 8), event(nodes[0], CPU, True, 0)])
    assert key(8) in presence and key(0) not in presence  # a lumped bit is never cleared


def test_a_snapshot_of_many_chunks_costs_at_most_16_bytes_each() -> None:
    presence = Presence(local=A)
    n = 200_000
    presence.apply([event(A, CPU, False, *range(n)), event(B, DISK, False, *range(0, n, 3))])
    assert len(presence) == n and presence.nbytes / n <= 16
    assert presence.in_memory(key(3), B) == A and presence.in_memory(key(n), A) is None


# ---- sharded Evictors: every poll to every shard, the snapshot their union -------------------
def test_two_shards_presence_is_their_union_and_waits_for_both() -> None:
    """A key held via shard 1 is a view hit as one via shard 0 is; the snapshot is taken
    only once both shards answered, and kept fresh by both shards' events."""
    view, channel = _view(shards=2)
    view.maybe_poll(0.0)
    assert sorted((w, s) for w, s, _ in channel.polls) == [
        ("events", 0),
        ("events", 1),
        ("status", 0),
        ("status", 1),
    ]
    channel.answer("events", EventBatch(3, 0, [event(A, CPU, False, 1)], "s0"), shard=0)
    assert not view.absent(key(2), 0.01)  # shard 1 not in yet: no snapshot, every key asked
    channel.answer("events", EventBatch(8, 0, [event(B, CPU, False, 2)], "s1"), shard=1)
    assert _in_memory(view, key(2), 0.05, A) == B  # held via shard 1: a view hit
    assert _in_memory(view, key(1), 0.05, A) == A
    assert view.absent(key(3), 0.05)
    view.maybe_poll(0.15)  # events since each shard's own cursor
    channel.answer("events", EventBatch(4, 0, [event(A, CPU, False, 3)], "s0"), shard=0)
    channel.answer("events", EventBatch(9, 0, [event(B, CPU, True, 2)], "s1"), shard=1)
    assert not view.absent(key(3), 0.2) and view.absent(key(2), 0.2)


def test_a_shard_whose_events_poll_failed_ages_the_whole_snapshot_out() -> None:
    """The snapshot is as fresh as its stalest shard: a chunk stored via shard 1 since
    its last answer may be missing, so the view stops answering MISS when that ages."""
    view, channel = _view(shards=2)
    view.maybe_poll(0.0)
    channel.answer("events", EventBatch(0, 0, [], "s0"), shard=0)
    channel.answer("events", EventBatch(0, 0, [], "s1"), shard=1)
    view.maybe_poll(0.15)
    channel.answer("events", EventBatch(0, 0, [], "s0"), shard=0)
    channel.answer("events", None, shard=1)
    assert view.absent(key(1), 0.19) and not view.absent(key(1), 0.21)


def test_a_gap_on_one_shard_drops_the_snapshot_and_every_shard_is_asked_again() -> None:
    for gap in (EventBatch(9, 3, [], "s1"), EventBatch(2, 0, [], "s1-restarted")):
        view, channel = _view(shards=2)
        view.maybe_poll(0.0)
        channel.answer("events", EventBatch(5, 0, [event(A, CPU, False, 1)], "s0"), shard=0)
        channel.answer("events", EventBatch(5, 0, [], "s1"), shard=1)
        assert view.absent(key(2), 0.05)
        view.maybe_poll(0.15)
        channel.answer("events", EventBatch(5, 0, [], "s0"), shard=0)
        channel.answer("events", gap, shard=1)
        assert not view.absent(key(2), 0.16)  # dropped: every key is asked meanwhile
        view.maybe_poll(0.3)  # a new snapshot, from both shards
        polled = sorted(s for w, s, _ in channel.polls if w == "events")
        assert polled == [0, 1]
        channel.answer("events", EventBatch(6, 0, [event(A, CPU, False, 1)], "s0"), shard=0)
        channel.answer("events", EventBatch(3, 0, [event(B, CPU, False, 2)], gap.epoch), shard=1)
        assert view.absent(key(3), 0.31) and _in_memory(view, key(2), 0.31, A) == B


def test_a_snapshot_round_with_a_failed_shard_is_not_kept() -> None:
    view, channel = _view(shards=2)
    view.maybe_poll(0.0)
    channel.answer("events", EventBatch(1, 0, [event(A, CPU, False, 1)], "s0"), shard=0)
    channel.answer("events", None, shard=1)
    assert not view.absent(key(2), 0.01)  # no snapshot: shard 1's part is missing
    view.maybe_poll(0.15)  # asked again, of both shards
    assert sorted(s for w, s, _ in channel.polls if w == "events") == [0, 1]


def test_the_status_gauges_sum_every_shards_last_status() -> None:
    """Each shard holds its share of a node's capacity and its own chunks and counters:
    the gauges are the sums; a shard that fails a poll counts with its last answer."""
    metrics = ManagerMetrics()
    channel = ManualChannel(shards=2)
    view = ClusterView(channel, NS, threading.RLock(), metrics, None, AGE_S)  # type: ignore[arg-type]

    def status(used: int, hits: int) -> dict[str, Any]:
        cpu = {"used_bytes": used, "capacity_bytes": 500, "chunks": used // 100}
        return {"nodes": {A: {"cpu": cpu}}, "totals": {"hits": hits}}

    def gauges() -> dict[str, Any]:
        stats = metrics.take()
        assert stats is not None
        values: dict[str, Any] = stats.data["data"]
        return {
            name: by_labels.get((A, "cpu"), by_labels.get(())) for name, by_labels in values.items()
        }

    view.maybe_poll(0.0)
    channel.answer("status", status(100, 2), shard=0)
    assert metrics.take() is None  # shard 1 not in yet
    channel.answer("status", status(300, 5), shard=1)
    got = gauges()
    assert got[TIER_USED] == 400 and got[TIER_CAPACITY] == 1000 and got[TIER_CHUNKS] == 4
    assert got[CLUSTER + "hits"] == 7
    view.maybe_poll(STATUS_PERIOD_S)
    channel.answer("status", status(200, 6), shard=0)
    channel.answer("status", None, shard=1)
    got = gauges()
    assert got[TIER_USED] == 500 and got[CLUSTER + "hits"] == 11
