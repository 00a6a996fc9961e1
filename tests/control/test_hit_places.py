"""The index counts each HIT by where its bytes are, against the asking node: every rank
on that node (a load that stays on the node) or some rank elsewhere (one that crosses
nodes). Both index implementations count alike."""

from __future__ import annotations

import pytest

from tests.control.test_index import NS, A, B, key, offer
from tierstore.control import compact_index
from tierstore.control.compact_index import CompactChunkIndex
from tierstore.control.index import ChunkIndex, LookupState, Watermarks

_KINDS = [
    "chunk",
    pytest.param(
        "compact",
        marks=pytest.mark.skipif(not compact_index.available(), reason="the C index was not built"),
    ),
]


def _index(kind: str) -> ChunkIndex | CompactChunkIndex:
    cls = ChunkIndex if kind == "chunk" else CompactChunkIndex
    index = cls("lru", Watermarks(0.9, 0.5), replicate_after_loads=0)
    for node in (A, B):
        index.register_node(node, 1000, 0)
    return index


@pytest.mark.parametrize("kind", _KINDS)
def test_hits_are_counted_by_whether_the_asking_node_holds_them(kind: str) -> None:
    index = _index(kind)
    index.admit(A, [offer(0)], now=0)
    index.admit(B, [offer(1)], now=0)
    answers, _ = index.lookup(NS, [key(0), key(1), key(2)], "h", 0, 10, A)
    assert [a.state for a in answers] == [LookupState.HIT, LookupState.HIT, LookupState.MISS]
    assert (index.stats.hits_same_node, index.stats.hits_other_node) == (1, 1)
    index.lookup(NS, [key(1)], "h", 0, 10, B)
    index.lookup(NS, [key(1)], "h", 0, 10)  # no asking node: not counted by place
    assert (index.stats.hits_same_node, index.stats.hits_other_node) == (2, 1)
    assert index.stats.hits == 4
