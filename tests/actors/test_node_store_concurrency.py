"""A load is served while a store on the same NodeStore waits on the Evictor (issue 12
item 4): the real actors, with the Evictor held up on purpose (``EvictorForTests.stall``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import ray
from tierstore.actors.bootstrap import get_or_create_node_store
from tierstore.actors.clients import NodeStoreClient

from tests.actors.hooks import start_evictor_for_tests
from tests.support import poll
from tierstore.config import TierStoreConfig
from tierstore.data.checksum import digest
from tierstore.keys import ChunkKey, Namespace
from tierstore.wire import ShardEntry

NS = Namespace("c0c0")
_STALL_MAX_S = 120.0  # the Evictor is released by the test long before this


def _chunk(i: int) -> tuple[ChunkKey, np.ndarray, list[ShardEntry]]:
    key = ChunkKey(bytes([i]) * 8 + b"\0\0\0\0")
    data = np.random.default_rng(i).integers(0, 256, 1024, dtype=np.uint8)
    return key, data, [ShardEntry(key, 0, data.nbytes, digest(data), 1)]


def test_a_load_is_served_while_a_store_waits_on_admit(
    cfg: TierStoreConfig, tmp_path: Path
) -> None:
    evictor = start_evictor_for_tests(cfg)
    node = ray.get_runtime_context().get_node_id()
    store = NodeStoreClient(get_or_create_node_store(cfg, node), node)
    held_key, held, entries = _chunk(1)
    assert store.store(NS, 0, 1, entries, held).result() == 1

    release = tmp_path / "release"
    stall = evictor.stall.remote(str(release), _STALL_MAX_S)
    # Store only once the Evictor is blocked: the admit must queue behind the stall.
    assert poll(lambda: (tmp_path / "release.stalled").exists(), 30), "the stall never began"
    new_key, new, new_entries = _chunk(2)
    pending = store.store(NS, 0, 1, new_entries, new)  # waits on the stalled admit
    try:
        # Before the concurrency groups this load queued behind the store, and timed out.
        (data,), metas = store.load(NS, 0, [held_key]).result()
        assert bytes(data) == bytes(held) and metas[0].digest == digest(held)
        assert store.status().result()["node_id"] == node  # answered too
        ready, _ = ray.wait([pending.ref], timeout=0)
        assert not ready, "the store finished: the Evictor was not stalled"
    finally:
        release.touch()
    ray.get(stall, timeout=_STALL_MAX_S)
    assert pending.result() == 1
    (data,), _ = store.load(NS, 0, [new_key]).result()
    assert bytes(data) == bytes(new)
