"""NodeStoreCore.load_views on a real arena: ``put`` sees the shards' own extents (no
copy made before it), and none of them is reused until ``put`` returns, even if the
shard is dropped and another stored meanwhile (what a data thread's put into the object
store relies on)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from tests.data.test_node_store_threads import NODE, NS, AdmitAll
from tierstore.control.index import NodeActions
from tierstore.data.arena.region import ArenaRegion
from tierstore.data.checksum import digest
from tierstore.data.tiers.arena import ArenaTier
from tierstore.keys import ChunkKey, ShardId
from tierstore.store.node_store import NodeStoreCore
from tierstore.wire import ShardEntry

KiB = 1 << 10
SHARD = 4 * KiB


@pytest.fixture
def core() -> Iterator[NodeStoreCore]:
    # Room for one shard's extent (the generation table takes a bit of the second
    # page): a second shard fits only by reusing the first's.
    region = ArenaRegion.create("ns-test", uuid.uuid4().hex, 2 * SHARD)
    tier = ArenaTier(region, capacity_bytes=SHARD)
    yield NodeStoreCore(NODE, tier, None, AdmitAll())
    tier.close()


def _store(core: NodeStoreCore, i: int) -> tuple[ChunkKey, int]:
    """Store shard ``i`` (every byte ``i``); returns its key and how many were kept."""
    key = ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\0")
    data = np.full(SHARD, i, dtype=np.uint8)
    return key, core.store(NS, 0, 1, [ShardEntry(key, 0, SHARD, digest(data), 1)], data)


def test_put_sees_the_extents_and_none_is_reused_before_it_returns(
    core: NodeStoreCore,
) -> None:
    key, kept = _store(core, 1)
    assert kept == 1
    arena = core.cpu.region.array  # type: ignore[attr-defined]
    during: list[int] = []

    def put(views: list[np.ndarray]) -> bytes:
        (view,) = views
        assert np.shares_memory(view, arena)  # the extent itself, not a copy
        core.apply(NodeActions(drop=[ShardId(NS, key, 0)]))  # a control thread's drop
        during.append(_store(core, 2)[1])  # no free extent yet: skipped, not written
        return view.tobytes()

    got, metas = core.load_views(NS, 0, [key], put)
    assert got == bytes(np.full(SHARD, 1, dtype=np.uint8)) and metas[0].nbytes == SHARD
    assert during == [0]
    key3, kept = _store(core, 3)  # put returned: the extent is free again
    assert kept == 1
    got, _ = core.load_views(NS, 0, [key3], lambda views: views[0].tobytes())
    assert got == bytes(np.full(SHARD, 3, dtype=np.uint8))
