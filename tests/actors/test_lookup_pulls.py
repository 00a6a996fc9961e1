"""Cross-node hits pulled when the lookup answers (issue 30), on two simulated nodes
(ray.cluster_utils), real NodeStores, Evictor and worker, no engine.

Node A's NodeStore holds a prompt's chunks; an engine on the driver's node (the head)
looks them up as its manager does: the lookup's HIT names A, and the head's NodeStore
starts pulling them into its own arena at once (one pull per holder). The worker's load
then reads that local copy, or waits for the pull in flight; a pull whose holder died
fails the load within its deadline (the request recomputes). Every test runs with each
``pull_transport``: the object store, and NIXL (the head reads A's extents in place)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
import torch
from tierstore.actors.bootstrap import (
    ensure_actors,
    find_node_store,
    get_or_create_evictor,
    shutdown_actors,
)
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.support import chain_entries, simulated_cluster, wait_for
from tierstore.config import TierStoreConfig
from tierstore.data.layout import ChunkLayout
from tierstore.keys import ChunkKey, Namespace, NodeId
from tierstore.spec import connect_worker
from tierstore.vllm.transfer_specs import LoadSpec
from tierstore.vllm.worker import TierStoreWorker
from tierstore.wire import LookupState

NAMESPACE = "tierstore-pull-tests"
NS = Namespace("9a11")
CHUNK_BYTES = 1 << 20
DEADLINE_S = 5.0  # the worker's transfer deadline
_WAIT_S = 30.0


def _keys(prompt: int, n: int = 3) -> list[ChunkKey]:
    return [ChunkKey(bytes([prompt, i]) + b"\0" * 10) for i in range(n)]


@pytest.fixture(scope="module", params=["object_store", "nixl"])
def two_nodes(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    cluster, (node_a,) = simulated_cluster(1, NAMESPACE)
    cfg = TierStoreConfig(
        cpu_bytes_per_node=64 << 20,
        namespace=NAMESPACE,
        transfer_timeout_s=DEADLINE_S,
        pull_transport=request.param,
    )
    ensure_actors(cfg)
    evictor = EvictorClient(get_or_create_evictor(cfg))
    a, head = node_a.node_id, ray.get_runtime_context().get_node_id()
    wait_for(
        lambda: {a, head} <= set(evictor.status().result()["nodes"]),
        "both nodes registered",
        _WAIT_S,
    )
    kv = torch.zeros((8, CHUNK_BYTES), dtype=torch.uint8)
    worker = connect_worker(cfg, ChunkLayout([kv], [[(0, CHUNK_BYTES)]], blocks_per_chunk=1))
    yield {
        "cluster": cluster,
        "a": a,
        "head": head,
        "evictor": evictor,
        "store_a": NodeStoreClient(find_node_store(NAMESPACE, a), a),
        "store_here": NodeStoreClient(find_node_store(NAMESPACE, head), head),
        "worker": worker,
        "kv": kv,
        "transport": request.param,
    }
    worker.shutdown()
    shutdown_actors(NAMESPACE)
    ray.shutdown()
    cluster.shutdown()


def _store_on_a(env: dict[str, Any], keys: list[ChunkKey], seed: int) -> np.ndarray:
    """The prompt's chunks held on node A, stored as a worker on A stores them."""
    payload = np.random.default_rng(seed).integers(0, 255, CHUNK_BYTES * len(keys), np.uint8)
    entries = chain_entries(keys, payload, CHUNK_BYTES)
    assert env["store_a"].store(NS, 0, 1, entries, payload).result() == len(keys)
    return payload


def _lookup_here(env: dict[str, Any], keys: list[ChunkKey], request: str) -> list[Any]:
    """The engine's manager's lookup from the head node: HITs naming A."""
    answers = env["evictor"].lookup(NS, keys, request, 30.0, env["head"]).result()
    assert [(a.state, a.where) for a in answers] == [(LookupState.HIT, {0: env["a"]})] * len(keys)
    return answers


def _load(env: dict[str, Any], keys: list[ChunkKey], job: int) -> tuple[bool, float]:
    """The worker's load of ``keys`` as planned from A's HITs: (success, seconds)."""
    worker: TierStoreWorker = env["worker"]
    env["kv"].zero_()
    spec = LoadSpec.build(NS, keys, [{0: NodeId(env["a"])}] * len(keys))
    started = time.monotonic()
    worker.submit_load(job, spec, GPULoadStoreSpec(list(range(len(keys))), [len(keys)], [0]))
    worker.wait({job})
    (result,) = worker.get_finished()
    assert result.job_id == job
    return result.success, time.monotonic() - started


def _pulls_here(env: dict[str, Any]) -> dict[str, int]:
    return env["store_here"].status().result()["pulls"]  # type: ignore[no-any-return]


def _lent_by_a(env: dict[str, Any]) -> int:
    """Extents A has pinned now (NIXL: lent to the head until it has read them)."""
    return env["store_a"].status().result()["arena"]["pinned_extents"]  # type: ignore[no-any-return]


def _loaded_from_a(env: dict[str, Any]) -> int:
    return env["store_a"].status().result()["stats"]["loaded_shards"]  # type: ignore[no-any-return]


def test_a_remote_hit_is_pulled_at_lookup_and_loaded_bit_exact_from_the_local_copy(
    two_nodes: dict[str, Any],
) -> None:
    env, keys = two_nodes, _keys(1)
    payload = _store_on_a(env, keys, seed=1)
    worker: TierStoreWorker = env["worker"]
    served_by_a, pulls = _loaded_from_a(env), _pulls_here(env)["pulls"]
    _lookup_here(env, keys, "request-1")
    # The pull message (Evictor -> head's NodeStore) and the load (worker -> head's
    # NodeStore) come from two callers, in no set order: a load that comes first reads
    # from A itself (correct, but both cross). Here the load follows the pull's start.
    wait_for(lambda: _pulls_here(env)["pulls"] == pulls + 1, "the pull started", _WAIT_S)
    ok, _ = _load(env, keys, job=1)  # it finds the copy, or joins its pull
    assert ok
    assert np.array_equal(env["kv"][: len(keys)].numpy().reshape(-1), payload)
    # One pull (one call to A for the request's three chunks), and nothing else from A:
    # the worker read the head's own copy, through its arena.
    assert _pulls_here(env)["pulls"] == pulls + 1
    assert _loaded_from_a(env) == served_by_a + len(keys)
    assert worker.relocated_loads == 0 and worker.arena.arena_loads >= 1
    assert worker.remote_named_bytes >= len(keys) * CHUNK_BYTES
    if env["transport"] == "nixl":  # read in place from A's extents into the head's
        assert _pulls_here(env)["read_in_place"] >= len(keys)
    # A lends its extents in place with NIXL: the loan ends once the head has read them.
    wait_for(lambda: _lent_by_a(env) == 0, "A's loans ended", _WAIT_S)
    # The copy is the Evictor's hot-chunk copy: lookups from here now name it.
    wait_for(
        lambda: all(
            a.where == {0: env["head"]}
            for a in env["evictor"].lookup(NS, keys, "request-1b", 30.0, env["head"]).result()
        ),
        "lookups from the head naming its own copy",
        _WAIT_S,
    )


def test_two_requests_asking_for_the_same_chunks_at_once_make_one_pull(
    two_nodes: dict[str, Any],
) -> None:
    env, keys = two_nodes, _keys(2)
    _store_on_a(env, keys, seed=2)
    served_by_a, before = _loaded_from_a(env), _pulls_here(env)
    _lookup_here(env, keys, "request-2a")
    _lookup_here(env, keys[:2], "request-2b")  # the same chunks, another request, at once
    wait_for(lambda: _pulls_here(env)["in_flight"] == 0, "the pull ended", _WAIT_S)
    after = _pulls_here(env)
    assert after["pulls"] == before["pulls"] + 1
    assert after["shards"] == before["shards"] + len(keys)
    assert _loaded_from_a(env) == served_by_a + len(keys)  # each chunk crossed once


def test_a_load_right_after_its_lookup_makes_one_pull_whichever_comes_first(
    two_nodes: dict[str, Any],
) -> None:
    """A view hit is loaded in the step that looks it up: the Evictor's pull message and
    the worker's load reach this node's NodeStore in no set order. Whichever comes first
    starts the pull and the other joins it (or finds the copy): one call to A, each chunk
    crosses once, and the copy is kept as the replica the lookup reserved."""
    env, keys = two_nodes, _keys(4)
    payload = _store_on_a(env, keys, seed=4)
    served_by_a, before = _loaded_from_a(env), _pulls_here(env)
    # As the scheduler sends it: not awaited; the load follows at once.
    lookup = env["evictor"].lookup(NS, keys, "request-4", 30.0, env["head"])
    ok, _ = _load(env, keys, job=4)
    assert ok
    assert [a.state for a in lookup.result()] == [LookupState.HIT] * len(keys)
    assert np.array_equal(env["kv"][: len(keys)].numpy().reshape(-1), payload)
    wait_for(lambda: _pulls_here(env)["in_flight"] == 0, "the pull ended", _WAIT_S)
    assert _pulls_here(env)["pulls"] == before["pulls"] + 1
    assert _loaded_from_a(env) == served_by_a + len(keys)
    wait_for(
        lambda: (
            env["evictor"].holders(NS, keys).result()
            == [frozenset({NodeId(env["a"]), NodeId(env["head"])})] * len(keys)
        ),
        "the head's copy indexed beside A's",
        _WAIT_S,
    )


def test_a_copy_a_load_pulled_unreserved_is_dropped(two_nodes: dict[str, Any]) -> None:
    """A load with no lookup before it (no copy reserved here) still starts the pull and
    loads right; the copy that lands is not kept: the Evictor has it dropped, and it
    still names A alone."""
    env, keys = two_nodes, _keys(5)
    payload = _store_on_a(env, keys, seed=5)
    before = _pulls_here(env)
    held_here = env["store_here"].status().result()["cpu"]["chunks"]
    ok, _ = _load(env, keys, job=5)
    assert ok
    assert np.array_equal(env["kv"][: len(keys)].numpy().reshape(-1), payload)
    assert _pulls_here(env)["started_by_loads"] == before["started_by_loads"] + 1
    wait_for(
        lambda: env["store_here"].status().result()["cpu"]["chunks"] == held_here,
        "the unreserved copy dropped",
        _WAIT_S,
    )
    assert env["evictor"].holders(NS, keys).result() == [frozenset({NodeId(env["a"])})] * 3


def test_a_pull_whose_holder_died_fails_the_load_within_its_deadline(
    two_nodes: dict[str, Any],
) -> None:
    """Last: it kills A's NodeStore."""
    env, keys = two_nodes, _keys(3)
    _store_on_a(env, keys, seed=3)
    worker: TierStoreWorker = env["worker"]
    failed_before = worker.failed_loads
    ray.kill(env["store_a"].handle)
    wait_for(lambda: _dead(env["store_a"]), "A's NodeStore dead", _WAIT_S)
    # The Evictor has not noticed yet (the next NodeStore on A is not registered):
    # the lookup still names A, and the head's pull of it fails.
    _lookup_here(env, keys, "request-3")
    ok, seconds = _load(env, keys, job=3)
    assert not ok and worker.failed_loads == failed_before + 1  # the request recomputes
    assert seconds < DEADLINE_S
    # The load failed joining the pull, or (the pull failed first) reading from A itself.
    # (A load that came first started a pull of its own, which failed too.)
    wait_for(lambda: _pulls_here(env)["failed"] >= 1, "the failed pull counted", _WAIT_S)
    assert not env["kv"].any()  # nothing of the chunks was written


def _dead(store: NodeStoreClient) -> bool:
    try:
        store.status().result(2.0)
    except Exception:
        return True
    return False
