"""Sharded Evictors (issue 28 item 1): ``evictor_shards`` Evictor actors, each owning the
prefix trees whose root maps to it and its share of every node's tiers.

Real Ray: the real Evictor shards and the node's real NodeStore, through their clients;
stores go through the NodeStore's ``store`` (an engine worker's object-store path), so
the roots the shards index come from the stored entries.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray
from tierstore.actors.bootstrap import (
    ensure_actors,
    evictor_clients,
    find_node_store,
    running_evictor_names,
    running_evictors,
    shutdown_actors,
)
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from tierstore.actors.names import evictor_name
from tierstore.actors.node_store_actor import capacity_shares
from tierstore.deploy.cli import collect_status, format_status

from tests.actors.conftest import NAMESPACE
from tests.actors.hooks import start_evictor_for_tests
from tests.support import poll, wait_for
from tierstore.config import ConfigMismatchError, TierStoreConfig
from tierstore.data.checksum import digest
from tierstore.errors import ClusterUnavailableError, TierStoreError
from tierstore.keys import ChunkKey, Namespace, ShardId, root_of, shard_of
from tierstore.wire import LookupState, ShardEntry

NS = Namespace("shards-test")
SHARDS = 2
# Odd, so the split has a remainder (it goes to shard 0).
CPU_BYTES = 64 * 1024 + 3
CHUNKS = 3  # per request: a chain from its first chunk
SHARD_BYTES = 256
_WAIT_S = 90.0  # a restart and a reconcile (every 2 s) on a loaded machine
_DEADLINE_S = 5.0  # the lookups' client deadline while a shard restarts
_SLACK_S = 10.0  # a deadline's overshoot allowed on a loaded machine


@pytest.fixture
def sharded(cfg: TierStoreConfig) -> Iterator[TierStoreConfig]:
    """The actor tests' config with two Evictor shards (the ``cfg`` fixture stops the
    actors after the test)."""
    yield dataclasses.replace(cfg, evictor_shards=SHARDS, cpu_bytes_per_node=CPU_BYTES)


def _node() -> str:
    return ray.get_runtime_context().get_node_id()


def _registered(evictor: EvictorClient, node: str) -> dict[str, int] | None:
    """The node's CPU tier as ``evictor`` has it registered, or None (not registered, or
    the shard is restarting)."""
    try:
        nodes = evictor.status().result()["nodes"]
    except (TierStoreError, ray.exceptions.RayError):
        return None
    return nodes.get(node, {}).get("cpu")


def test_every_shard_starts_and_holds_its_share_of_each_node(sharded: TierStoreConfig) -> None:
    ensure_actors(sharded)
    node = _node()
    evictors = evictor_clients(sharded)
    assert [e.status().result()["shard"] for e in evictors] == [0, 1]
    assert {e.status().result()["shards"] for e in evictors} == {SHARDS}
    assert running_evictor_names(NAMESPACE) == [evictor_name(0), evictor_name(1)]
    shares = capacity_shares(CPU_BYTES, SHARDS)
    assert shares == [CPU_BYTES // 2 + 1, CPU_BYTES // 2]
    for evictor, share in zip(evictors, shares, strict=True):
        cpu = _registered(evictor, node)
        assert cpu is not None and cpu["capacity_bytes"] == share

    status = collect_status(NAMESPACE)
    assert [s["cpu"]["capacity_bytes"] for s in status["shards"]] == shares
    assert "evictor shard 1: indexed 0 chunks" in format_status(status)
    assert shutdown_actors(NAMESPACE) == SHARDS + 1  # and the node's NodeStore
    assert running_evictor_names(NAMESPACE) == []


def test_other_shard_counts_are_refused_before_anything_starts(cfg: TierStoreConfig) -> None:
    ensure_actors(cfg)  # one shard
    more = dataclasses.replace(cfg, evictor_shards=3)
    with pytest.raises(ConfigMismatchError, match="evictor_shards: running 1, this config 3"):
        ensure_actors(more)
    assert running_evictor_names(NAMESPACE) == [evictor_name(0)]  # shard 1 never started


def test_an_auto_config_adopts_the_number_shard_0_runs_with(sharded: TierStoreConfig) -> None:
    """Two shards set by hand on this one node, where "auto" would choose one: a later
    "auto" caller (an engine, `tierstore up`) uses both."""
    ensure_actors(sharded)
    auto = dataclasses.replace(sharded, evictor_shards="auto")
    assert running_evictors(auto)[0] == sharded
    assert len(evictor_clients(auto)) == SHARDS
    ensure_actors(auto)  # its NodeStore check passes too


def test_only_shard_0_places_node_stores(sharded: TierStoreConfig, tmp_path: Path) -> None:
    """Shard 0 held up: a NodeStore gone from its node is not placed again by shard 1's
    reconcile; shard 0's places it once it runs again."""
    zero = start_evictor_for_tests(sharded, 0)
    ensure_actors(sharded)
    node = _node()
    one = evictor_clients(sharded)[1]
    release = tmp_path / "release"
    zero.stall.remote(str(release), 120.0)
    try:
        wait_for(Path(f"{release}.stalled").exists, "shard 0 stalled", 30.0)
        ray.kill(find_node_store(NAMESPACE, node), no_restart=True)
        wait_for(lambda: not _node_store_exists(node), "the NodeStore gone", 30.0)
        assert one.reconcile().result()["started"] == []
        assert not _node_store_exists(node)
    finally:
        release.touch()
    wait_for(lambda: _node_store_exists(node), "a NodeStore placed by shard 0", _WAIT_S)


def _node_store_exists(node: str) -> bool:
    try:
        find_node_store(NAMESPACE, node)
        return True
    except ClusterUnavailableError:
        return False


def test_a_restarted_shard_has_the_node_register_its_share_again(
    sharded: TierStoreConfig,
) -> None:
    ensure_actors(sharded)
    node = _node()
    evictors = evictor_clients(sharded)
    _kill_and_wait_restarted(evictors[1])
    shares = capacity_shares(CPU_BYTES, SHARDS)
    cpu = poll(lambda: _registered(evictors[1], node), _WAIT_S, poll_s=0.2)
    assert cpu is not None and cpu["capacity_bytes"] == shares[1], "never re-registered"
    cpu = _registered(evictors[0], node)
    assert cpu is not None and cpu["capacity_bytes"] == shares[0]


def _kill_and_wait_restarted(evictor: EvictorClient) -> None:
    """Kill an Evictor shard (Ray restarts it) and return once its new incarnation
    answers: the old one carries a mark (a failed store counted) the new one lacks. A kill
    is asynchronous: a call sent right after it may still reach the old one."""
    evictor.report_failed_stores(1).result()
    ray.kill(evictor.handle, no_restart=False)

    def marked() -> bool | None:
        try:
            return evictor.status().result()["totals"]["failed_stores"] == 1
        except (TierStoreError, ray.exceptions.RayError):
            return None  # restarting

    wait_for(lambda: marked() is False, "the shard's new incarnation", _WAIT_S)


# ---- chunks routed by their prefix tree's root ----------------------------------------


def _first_keys(per_shard: int = 2) -> dict[int, list[ChunkKey]]:
    """``per_shard`` requests' first chunks per shard: their roots map to it."""
    found: dict[int, list[ChunkKey]] = {shard: [] for shard in range(SHARDS)}
    n = 0
    while any(len(keys) < per_shard for keys in found.values()):
        n += 1
        key = ChunkKey(n.to_bytes(8, "big") + bytes(4))
        shard = shard_of(root_of(NS, key), SHARDS)
        if len(found[shard]) < per_shard:
            found[shard].append(key)
    return found


def _chain(first: ChunkKey) -> list[ChunkKey]:
    """A request's chunks: its first, then ``CHUNKS - 1`` more chained after it."""
    base = int.from_bytes(first[:8], "big") << 16
    return [first] + [ChunkKey((base + i).to_bytes(8, "big") + bytes(4)) for i in range(1, CHUNKS)]


def _store(store: NodeStoreClient, *firsts: ChunkKey) -> list[ChunkKey]:
    """Requests' store through the NodeStore in one job (a worker's object-store job):
    every entry carries its request's root. Returns their keys, all kept."""
    keys = [key for first in firsts for key in _chain(first)]
    assert _send(store, firsts) == len(keys)
    return keys


def _send(store: NodeStoreClient, firsts: tuple[ChunkKey, ...]) -> int:
    """The job of :func:`_store`; returns the shards the NodeStore kept."""
    chains = [(root_of(NS, first), _chain(first)) for first in firsts]
    n = sum(len(chain) for _, chain in chains)
    seed = int.from_bytes(b"".join(firsts), "big")
    buffer = np.random.default_rng(seed).integers(0, 256, SHARD_BYTES * n, dtype=np.uint8)
    entries = []
    for root, chain in chains:
        for i, key in enumerate(chain):
            at = len(entries) * SHARD_BYTES
            data = buffer[at : at + SHARD_BYTES]
            parent = chain[i - 1] if i else None
            entries.append(ShardEntry(key, at, SHARD_BYTES, digest(data), 1, parent, root))
    return store.store(NS, 0, 1, entries, buffer).result()


def _states(evictor: EvictorClient, keys: list[ChunkKey]) -> list[LookupState]:
    answers = evictor.lookup(NS, keys, "shards-test", 1.0).result()
    evictor.release(NS, keys, "shards-test")
    return [a.state for a in answers]


def _stored(sharded: TierStoreConfig) -> tuple[NodeStoreClient, dict[int, list[ChunkKey]]]:
    """Every test request stored through the node's NodeStore; its keys per shard."""
    ensure_actors(sharded)
    node = _node()
    store = NodeStoreClient(find_node_store(NAMESPACE, node), node)
    keys: dict[int, list[ChunkKey]] = {}
    for shard, firsts in _first_keys().items():
        keys[shard] = [key for first in firsts for key in _store(store, first)]
    for shard, evictor in enumerate(evictor_clients(sharded)):  # all indexed
        assert _states(evictor, keys[shard]) == [LookupState.HIT] * len(keys[shard])
    return store, keys


def test_each_chunk_is_indexed_by_the_shard_of_its_root_and_nowhere_else(
    sharded: TierStoreConfig,
) -> None:
    store, keys = _stored(sharded)
    node = _node()
    evictors = evictor_clients(sharded)
    for shard, evictor in enumerate(evictors):
        indexed = {shard_id for shard_id, _ in evictor.index_view(node).result()}
        assert indexed == {ShardId(NS, key, 0) for key in keys[shard]}, f"shard {shard}"
        assert _states(evictor, keys[shard]) == [LookupState.HIT] * len(keys[shard])
        other = keys[1 - shard]
        assert _states(evictor, other) == [LookupState.MISS] * len(other)
        status = evictor.status().result()
        assert status["chunks"] == len(keys[shard])
        assert status["nodes"][node]["cpu"]["chunks"] == len(keys[shard])
    held = {shard_id for shard_id, _ in store.inventory().result()}
    assert held == {ShardId(NS, key, 0) for shard in keys for key in keys[shard]}


def test_a_killed_shard_misses_its_roots_until_the_node_store_offers_them_again(
    sharded: TierStoreConfig,
) -> None:
    """Shard 1 killed while lookups of both shards run: shard 1's roots answer MISS (or
    its client's deadline fires: never later) until its reconcile has the NodeStore
    re-offer them, then HIT; shard 0's roots HIT throughout; the NodeStore keeps all."""
    store, keys = _stored(sharded)
    held = store.inventory().result()
    evictors = evictor_clients(sharded, timeout_s=_DEADLINE_S)
    stop = threading.Event()
    zero_states: list[list[LookupState] | str] = []
    late: list[float] = []

    def look_up_shard_0() -> None:  # "under load": shard 0 asked all along
        while not stop.is_set():
            try:
                zero_states.append(_states(evictors[0], keys[0]))
            except TierStoreError as exc:
                zero_states.append(repr(exc))

    def shard_1_states() -> list[LookupState]:
        started = time.monotonic()
        try:
            return _states(evictors[1], keys[1])
        except TierStoreError:  # unavailable, or its deadline: the scheduler's MISS
            return [LookupState.MISS] * len(keys[1])
        finally:
            if time.monotonic() - started > _DEADLINE_S + _SLACK_S:
                late.append(time.monotonic() - started)

    looker = threading.Thread(target=look_up_shard_0, daemon=True)
    looker.start()
    try:
        _kill_and_wait_restarted(evictors[1])
        hit = [LookupState.HIT] * len(keys[1])
        states = poll(shard_1_states, _WAIT_S, poll_s=0.1, done=lambda s: s == hit)
        assert states == hit, "shard 1 never indexed its roots again"
    finally:
        stop.set()
        looker.join(_WAIT_S)
    assert late == [], "a lookup of the restarting shard outlived its client's deadline"
    assert zero_states and all(s == [LookupState.HIT] * len(keys[0]) for s in zero_states)
    assert store.inventory().result() == held  # nothing lost on the NodeStore
    node = _node()
    indexed = {shard_id for shard_id, _ in evictors[1].index_view(node).result()}
    assert indexed == {ShardId(NS, key, 0) for key in keys[1]}  # its share only


def test_a_shard_that_lost_the_node_has_the_node_store_reregister_with_it(
    sharded: TierStoreConfig,
) -> None:
    """Shard 1 forgot the node and its reconciles do nothing: a store whose job spans
    both shards keeps shard 0's part and has the NodeStore reregister with shard 1 by
    itself (shard 1's chunks HIT again); a store for shard 1 alone is retried after the
    NodeStore reregistered, and kept."""
    one = start_evictor_for_tests(sharded, 1)
    store, keys = _stored(sharded)
    held = store.inventory().result()
    node = _node()
    evictors = evictor_clients(sharded)
    ray.get(one.pause_reconciles.remote(True), timeout=_WAIT_S)
    hits = [LookupState.HIT] * len(keys[1])

    evictors[1].forget_node(node).result()
    assert _states(evictors[1], keys[1]) == [LookupState.MISS] * len(keys[1])
    firsts = _first_keys(per_shard=4)
    mixed = (firsts[0][2], firsts[1][2])
    assert _send(store, mixed) == CHUNKS  # shard 0's part; shard 1 refused it
    assert _states(evictors[0], _chain(mixed[0])) == [LookupState.HIT] * CHUNKS
    states = poll(lambda: _states(evictors[1], keys[1]), _WAIT_S, done=lambda s: s == hits)
    assert states == hits, "the NodeStore never reregistered with shard 1"
    assert held <= store.inventory().result()

    evictors[1].forget_node(node).result()
    alone = _store(store, firsts[1][3])  # retried after reregistering: kept
    assert _states(evictors[1], alone + keys[1]) == [LookupState.HIT] * (len(alone) + len(hits))
