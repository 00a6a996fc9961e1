"""Copies started at lookup time (issue 30: a node about to load chunks held elsewhere
pulls them at once): the replica rules hold, without a count of loads, and both indexes
decide alike."""

from __future__ import annotations

import pytest

from tests.control.test_index import CPU, NS, A, B, key, offer, sid
from tierstore.control.compact_index import CompactChunkIndex
from tierstore.control.index import ChunkIndex, LookupState, Watermarks
from tierstore.keys import NodeId

C = NodeId("node-c")
INDEXES = [ChunkIndex, CompactChunkIndex]


def _cluster(kind: type, cpu: int = 1000) -> ChunkIndex:
    index = kind("lru", Watermarks(0.9, 0.5), replicate_after_loads=0)  # 0: no counted copies
    for node in (A, B, C):
        index.register_node(node, cpu, 0)
    return index  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", INDEXES)
def test_a_copy_starts_at_the_first_lookup_once_and_serves_once_landed(kind: type) -> None:
    index = _cluster(kind)
    index.admit(A, [offer(0), offer(1)], now=0)
    actions = index.start_copies(NS, [key(0), key(1)], B)
    assert sorted(actions[A].push) == [(sid(0), B), (sid(1), B)]  # the holder's part, one call
    assert index.nodes()[B][CPU] == (200, 1000, 2)  # room reserved at once
    # A second request asking meanwhile starts nothing: one pull per chunk and node.
    assert index.start_copies(NS, [key(0), key(1)], B) == {}
    assert index.start_copies(NS, [key(0)], A) == {}  # the holder itself: nothing
    (answer,), _ = index.lookup(NS, [key(0)], "h", 0, 10, B)
    assert answer.state is LookupState.HIT and answer.where == {0: A}  # not landed yet
    actions = index.replicated(B, [sid(0)], [sid(1)])  # one landed, one failed
    assert actions[B].drop == [sid(1)]
    (answer,), _ = index.lookup(NS, [key(0)], "h", 0, 10, B)
    assert answer.where == {0: B}
    assert index.nodes()[B][CPU] == (100, 1000, 1)  # the failed copy's room given back


@pytest.mark.parametrize("kind", INDEXES)
def test_no_copy_above_the_low_watermark_or_of_an_unknown_chunk(kind: type) -> None:
    index = _cluster(kind, cpu=300)  # low watermark 150 bytes
    index.admit(A, [offer(0)], now=0)
    index.admit(B, [offer(1)], now=0)  # B at 100 of 300: one more chunk passes 150
    assert index.start_copies(NS, [key(0), key(7)], B) == {}
    assert index.replicas_on(B) == set()
    assert index.start_copies(NS, [key(0)], NodeId("not-registered")) == {}
