"""Kill the Evictor: it comes back and rebuilds its index from the NodeStores."""

from __future__ import annotations

import time

import ray
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from actors.bootstrap import get_or_create_evictor
from tests.actors.test_worker_roundtrip import NS, _drain, _keys, _kv, _load_spec, _lookup, _worker
from tierstore.config import TierStoreConfig
from tierstore.control.index import LookupState
from tierstore.vllm.transfer_specs import StoreSpec


def test_killed_evictor_restarts_and_reindexes_every_chunk(cfg: TierStoreConfig) -> None:
    worker = _worker(cfg, _kv())
    keys = _keys(5, 0)
    for i, key in enumerate(keys):
        src = GPULoadStoreSpec([1, 2], group_sizes=[2, 0], block_indices=[0, 0])
        worker.submit_store(i, src, StoreSpec(NS, (key,)))
    assert len(_drain(worker, len(keys))) == len(keys)
    evictor = get_or_create_evictor(cfg)
    assert ray.get(evictor.status.remote())["chunks"] == 5

    ray.kill(evictor, no_restart=False)
    deadline = time.monotonic() + 90  # a restart spawns a new worker process: slow under load
    chunks = 0
    while time.monotonic() < deadline:
        try:
            chunks = ray.get(evictor.status.remote(), timeout=5)["chunks"]
        except ray.exceptions.RayError:  # unavailable while it restarts
            chunks = 0
        if chunks == 5:
            break
        time.sleep(0.1)
    assert chunks == 5, "the restarted Evictor did not rebuild its index"
    states: list[LookupState] = []
    while time.monotonic() < deadline:
        try:  # the caller's view of a restarted actor can lag a moment behind under load
            states = _lookup(cfg, keys)
            break
        except ray.exceptions.ActorUnavailableError:
            time.sleep(0.2)
    assert states == [LookupState.HIT] * 5
    _load_spec(cfg, keys)  # and they load
