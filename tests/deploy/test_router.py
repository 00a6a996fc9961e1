"""TierAwareRouter (``tierstore.deploy.router``): a Ray Serve request router that ranks
replicas by what tierstore holds on their node, on two simulated nodes
(``ray.cluster_utils``), real Serve, real tierstore actors, no engine.

Each app is a small deployment with one replica on node A and one on node B, answering
with its node. Chunks are stored on a node's NodeStore under the keys vLLM's scheduler
computes for the prompt (a vLLM ``Request``'s block hashes, vLLM's ``make_offload_key``),
as a worker there stores them. A request goes to the replica on the node holding its
prefix; with no holder it goes to the replica with the shorter queue; when tierstore's
answer is late it is routed as Ray's default router routes it."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.serve.llm", reason="Ray Serve is not installed (the [serve] extra)")

import ray
from ray import cloudpickle, serve
from ray.cluster_utils import Cluster
from ray.serve.config import RequestRouterConfig
from tierstore.actors.bootstrap import (
    ensure_actors,
    find_node_store,
    get_or_create_evictor,
    shutdown_actors,
)
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import Request

from tests.support import LOOPBACK, chain_entries, free_port, wait_for
from tierstore.config import TierStoreConfig
from tierstore.keys import ChunkKey, Namespace

NAMESPACE = "tierstore-router-tests"
NS = Namespace("70a7e4")
BLOCK = 16
CHUNK_BYTES = 64 << 10
SLOT = "router_test_slot"  # a resource only nodes A and B have: one replica per app each
_WAIT_S = 60.0
_ROUTER = "tierstore.deploy.router:TierAwareRouter"


@serve.deployment(
    num_replicas=2,
    max_replicas_per_node=1,
    max_ongoing_requests=8,
    ray_actor_options={"num_cpus": 0, "resources": {SLOT: 1}},
)
class Where:
    """Answers with its node, after ``sleep_s`` (a request that keeps its replica busy)."""

    async def __call__(self, request: dict[str, Any]) -> str:
        await asyncio.sleep(request.get("sleep_s", 0.0))
        return str(ray.get_runtime_context().get_node_id())


def _router_config(**kwargs: Any) -> RequestRouterConfig:
    return RequestRouterConfig(
        request_router_class=_ROUTER,
        request_router_kwargs={
            "namespace": NS,
            "block_size": BLOCK,
            "ray_namespace": NAMESPACE,
            **kwargs,
        },
    )


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "node_ip_address": LOOPBACK,
        },
    )
    a, b = (
        cluster.add_node(num_cpus=1, resources={SLOT: 2}, node_ip_address=LOOPBACK)
        for _ in range(2)
    )
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Where, on the replicas
    cfg = TierStoreConfig(cpu_bytes_per_node=64 << 20, namespace=NAMESPACE)
    ensure_actors(cfg)
    evictor = EvictorClient(get_or_create_evictor(cfg))
    wait_for(
        lambda: {a.node_id, b.node_id} <= set(evictor.status().result()["nodes"]),
        "both NodeStores registered",
        _WAIT_S,
    )
    serve.start(http_options={"host": LOOPBACK, "port": free_port()})
    tiers = serve.run(
        Where.options(request_router_config=_router_config()).bind(),
        name="tiers",
        route_prefix="/tiers",
    )
    # Its Evictor answer can never come in time (1 us): every request falls back.
    late = serve.run(
        Where.options(request_router_config=_router_config(index_timeout_s=1e-6)).bind(),
        name="late",
        route_prefix="/late",
    )
    init_none_hash(sha256)  # as an engine does when it starts (vLLM's default hash)
    yield {
        "a": a.node_id,
        "b": b.node_id,
        "tiers": tiers,
        "late": late,
        "stores": {
            n.node_id: NodeStoreClient(find_node_store(NAMESPACE, n.node_id), n.node_id)
            for n in (a, b)
        },
        "rng": np.random.default_rng(31),
    }
    serve.shutdown()
    shutdown_actors(NAMESPACE)
    ray.shutdown()
    cluster.shutdown()


def _prompt(env: dict[str, Any], blocks: int = 4) -> list[int]:
    """A prompt of its own (no block shared with another), a partial block at its end."""
    return [int(t) for t in env["rng"].integers(0, 30_000, blocks * BLOCK + 5)]


def _engine_keys(prompt: list[int]) -> list[ChunkKey]:
    """The offload keys vLLM's scheduler gives the prompt's chunks (one group, a block
    per chunk): its Request's block hashes, each with group index 0."""
    request = Request(
        request_id="keys",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    return [ChunkKey(make_offload_key(h, 0)) for h in request.block_hashes]


def _store(env: dict[str, Any], node: str, keys: list[ChunkKey]) -> None:
    """``keys``' chunks held by ``node``'s NodeStore, as a worker there stores them."""
    payload = env["rng"].integers(0, 255, CHUNK_BYTES * len(keys), np.uint8)
    entries = chain_entries(keys, payload, CHUNK_BYTES)
    assert env["stores"][node].store(NS, 0, 1, entries, payload).result() == len(keys)


def _served_by(handle: Any, prompt: list[int]) -> str:
    return str(handle.remote({"prompt": prompt}).result(timeout_s=_WAIT_S))


def test_a_request_goes_to_the_replica_on_the_node_holding_its_prefix(
    env: dict[str, Any],
) -> None:
    for holder in [env["a"], env["b"]] * 3:
        prompt = _prompt(env)
        _store(env, holder, _engine_keys(prompt))
        assert _served_by(env["tiers"], prompt) == holder


def test_a_prefix_split_over_two_nodes_goes_to_the_node_holding_its_start(
    env: dict[str, Any],
) -> None:
    """A chunk is held once: an engine on ``rest`` that loaded the first two chunks from
    ``start`` stored only the next three. Only ``start`` can load a prefix locally."""
    for start, rest in [(env["a"], env["b"]), (env["b"], env["a"])] * 2:
        prompt = _prompt(env, blocks=6)
        keys = _engine_keys(prompt)
        _store(env, start, keys[:2])
        _store(env, rest, keys[2:5])
        assert _served_by(env["tiers"], prompt) == start


def test_a_prefix_on_a_replicas_device_beats_one_in_tierstore_on_another_node(
    env: dict[str, Any],
) -> None:
    """A prompt this router sent to a replica is in that replica's device cache: it goes
    back there, though tierstore holds it on the other replica's node."""
    for _ in range(3):
        prompt = _prompt(env)
        first = _served_by(env["tiers"], prompt)  # nothing held: by load
        other = env["b"] if first == env["a"] else env["a"]
        _store(env, other, _engine_keys(prompt))
        assert _served_by(env["tiers"], prompt) == first


def test_with_no_holder_a_request_goes_to_the_shorter_queue(env: dict[str, Any]) -> None:
    busy_prompts = [_prompt(env) for _ in range(2)]
    for prompt in busy_prompts:
        _store(env, env["a"], _engine_keys(prompt))
    busy = [env["tiers"].remote({"prompt": p, "sleep_s": 6.0}) for p in busy_prompts]
    time.sleep(0.5)  # both sent to A's replica, which holds them now
    try:
        served = [_served_by(env["tiers"], _prompt(env)) for _ in range(5)]
    finally:
        assert [r.result(timeout_s=_WAIT_S) for r in busy] == [env["a"]] * 2
    assert served == [env["b"]] * 5


def test_a_late_index_answer_falls_back_to_rays_default_routing(
    env: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tierstore.deploy.router")
    served = []
    started = time.monotonic()
    for _ in range(14):
        prompt = _prompt(env)
        _store(env, env["a"], _engine_keys(prompt))
        served.append(_served_by(env["late"], prompt))
    # Every request is served at once, by either replica (A held every prefix: ranked,
    # all would have gone to A; Ray's default picks by queue length, at random here).
    assert time.monotonic() - started < 30.0
    assert set(served) == {env["a"], env["b"]}, served
    late = [r for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(late) >= 14
