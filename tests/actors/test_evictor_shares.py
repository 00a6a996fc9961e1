"""Evictor shards' shares of a node rebalanced by credit (issue 28 item 1): stores skewed
to one shard's prefix trees (one hot system prompt) get more than that shard's static
half of the node's CPU tier, and keep it, while the shards' shares never add up to more
than the tier and the cold shard still admits.

Real Ray: two real Evictor shards and the node's real NodeStore, whose rebalancer thread
moves the shares; stores go through the NodeStore's ``store`` (a worker's object-store
job), lookups to the hot shard's client.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import pytest
import ray
from tierstore.actors.bootstrap import ensure_actors, evictor_clients, find_node_store
from tierstore.actors.clients import EvictorClient, NodeStoreClient

from tests.actors.conftest import NAMESPACE
from tests.actors.test_evictor_shards import (
    NS,
    SHARD_BYTES,
    _chain,
    _first_keys,
    _kill_and_wait_restarted,
    _registered,
    _send,
    _states,
)
from tests.support import poll
from tierstore.config import TierStoreConfig
from tierstore.control.shares import share_floor
from tierstore.keys import ChunkKey, ShardId
from tierstore.wire import LookupState

CPU_BYTES = 64 * 1024  # 256 chunks of SHARD_BYTES; each shard's static half: 128
HOT_REQUESTS = 60  # 3 chunks each: 180 chunks, 45 KiB: more than the half, less than
# what the hot shard may get (the tier less the cold shard's floor: 56 KiB)
_WAIT_S = 40.0


@pytest.fixture
def sharded(cfg: TierStoreConfig) -> Iterator[TierStoreConfig]:
    """Two Evictor shards, no disk tier (a shard's evictions are drops: what is not in its
    share is lost); the ``cfg`` fixture stops the actors after the test."""
    yield dataclasses.replace(cfg, evictor_shards=2, cpu_bytes_per_node=CPU_BYTES)


def _cpu(evictor: EvictorClient, node: str) -> dict[str, int]:
    cpu: dict[str, int] = evictor.status().result()["nodes"][node]["cpu"]
    return cpu


class ShareWatch:
    """Reads both shards' CPU shares of the node over and over (a thread), keeping each
    reading whose first shard read the same before and after the second's (no resize
    of the first fell between): their sum, as it stood at one instant."""

    def __init__(self, evictors: list[EvictorClient], node: str) -> None:
        self._evictors, self._node = evictors, node
        self.sums: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            first = _cpu(self._evictors[0], self._node)["capacity_bytes"]
            second = _cpu(self._evictors[1], self._node)["capacity_bytes"]
            if _cpu(self._evictors[0], self._node)["capacity_bytes"] == first:
                self.sums.append(first + second)
            time.sleep(0.02)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(_WAIT_S)
        return self.sums


def _skewed(
    store: NodeStoreClient, evictors: list[EvictorClient], firsts: dict[int, list[ChunkKey]]
) -> list[LookupState]:
    """One hot prompt's traffic: shard 0's requests stored and looked up until all HIT
    (or the wait ran out), then rounds with nothing stored; their states then."""
    keys = [key for first in firsts[0] for key in _chain(first)]
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        for at in range(0, HOT_REQUESTS, 10):
            _send(store, tuple(firsts[0][at : at + 10]))
        if _states(evictors[0], keys) == [LookupState.HIT] * len(keys):
            break
        time.sleep(0.2)
    time.sleep(2.5)  # rounds with nothing more stored: the hot shard keeps it all
    return _states(evictors[0], keys)


def test_skewed_stores_get_more_than_the_static_half_and_keep_it(
    sharded: TierStoreConfig,
) -> None:
    ensure_actors(sharded)
    node = ray.get_runtime_context().get_node_id()
    store = NodeStoreClient(find_node_store(NAMESPACE, node), node)
    evictors = evictor_clients(sharded)
    firsts = _first_keys(per_shard=HOT_REQUESTS)
    hot, cold = 0, 1
    assert _send(store, tuple(firsts[cold][:2])) == 6  # the cold shard holds a little
    watch = ShareWatch(evictors, node)
    keys = [key for first in firsts[hot] for key in _chain(first)]
    try:
        states = _skewed(store, evictors, firsts)
    finally:
        sums = watch.stop()

    half = CPU_BYTES // 2
    assert states == [LookupState.HIT] * len(keys), (
        f"{states.count(LookupState.HIT)} of {len(keys)} hot chunks held; the hot shard "
        f"kept {_cpu(evictors[hot], node)} of its node"
    )
    hot_cpu = _cpu(evictors[hot], node)
    assert hot_cpu["chunks"] == len(keys) and hot_cpu["used_bytes"] == len(keys) * SHARD_BYTES
    assert hot_cpu["used_bytes"] > half and hot_cpu["capacity_bytes"] > half
    inventory = {shard_id for shard_id, _ in store.inventory().result()}
    assert {ShardId(NS, key, 0) for key in keys} <= inventory  # the bytes are on the node

    assert sums and max(sums) <= CPU_BYTES, f"shares added up to {max(sums)}"
    cold_cpu = _cpu(evictors[cold], node)
    assert hot_cpu["capacity_bytes"] + cold_cpu["capacity_bytes"] <= CPU_BYTES
    assert cold_cpu["capacity_bytes"] >= share_floor(CPU_BYTES, 2)
    shares = store.status().result()["shares"]["cpu"]  # what a restarted shard gets
    assert shares == [hot_cpu["capacity_bytes"], cold_cpu["capacity_bytes"]][:: 1 - 2 * hot]

    more = _chain(firsts[cold][2])
    assert _send(store, (firsts[cold][2],)) == len(more)  # the cold shard still admits
    assert _states(evictors[cold], more + _chain(firsts[cold][0])) == [LookupState.HIT] * 6


def test_a_restarted_shard_registers_its_current_share_not_the_static_split(
    sharded: TierStoreConfig,
) -> None:
    """After the skew moved the shares, the cold shard is killed (Ray restarts it): the
    NodeStore registers it again with its current share, so the shares still add up to
    the tier and the hot shard keeps its chunks."""
    ensure_actors(sharded)
    node = ray.get_runtime_context().get_node_id()
    store = NodeStoreClient(find_node_store(NAMESPACE, node), node)
    evictors = evictor_clients(sharded)
    firsts = _first_keys(per_shard=HOT_REQUESTS)
    keys = [key for first in firsts[0] for key in _chain(first)]
    assert _skewed(store, evictors, firsts) == [LookupState.HIT] * len(keys)
    shares = store.status().result()["shares"]["cpu"]
    assert shares[1] < CPU_BYTES // 2 < shares[0] and sum(shares) <= CPU_BYTES

    _kill_and_wait_restarted(evictors[1])
    cpu = poll(lambda: _registered(evictors[1], node), _WAIT_S, poll_s=0.2)
    assert cpu is not None, "the restarted shard never got the node again"
    assert cpu["capacity_bytes"] == shares[1]  # not the static CPU_BYTES // 2
    assert _cpu(evictors[0], node)["capacity_bytes"] + cpu["capacity_bytes"] <= CPU_BYTES
    assert _states(evictors[0], keys) == [LookupState.HIT] * len(keys)
