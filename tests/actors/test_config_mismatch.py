"""Actors already running with another config: a later engine or `tierstore up` that names
other values for the keys that define them is refused, naming each key and both values,
before it starts anything; keys of one engine alone may differ. And `tierstore up` waits
for its actors with a deadline."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import ray
from tierstore.actors.bootstrap import ensure_actors, find_node_store, get_or_create_node_store
from tierstore.actors.clients import EvictorClient, NodeStoreClient
from tierstore.actors.placement import EVICTOR_NAME
from tierstore.deploy.cli import _wait_with_progress

from tests.actors.conftest import NAMESPACE
from tests.actors.hooks import start_evictor_for_tests
from tests.support import wait_for
from tierstore.config import ConfigMismatchError, TierStoreConfig
from tierstore.errors import RemoteCallTimeout

_DEADLINE_S = 1.0
_SLACK_S = 10.0  # a deadline's overshoot allowed on a loaded machine


def _as_run(cfg: TierStoreConfig) -> TierStoreConfig:
    """``cfg`` as the actors run it on this one-node cluster: ``"auto"`` is one shard."""
    return dataclasses.replace(cfg, evictor_shards=1)


def _running(node: str) -> tuple[TierStoreConfig, TierStoreConfig]:
    evictor = EvictorClient(ray.get_actor(EVICTOR_NAME, namespace=NAMESPACE))
    store = NodeStoreClient(find_node_store(NAMESPACE, node), node)
    return evictor.config().result(), store.config().result()


def test_an_engine_with_other_actor_keys_is_refused_naming_them(cfg: TierStoreConfig) -> None:
    ensure_actors(cfg)
    node = ray.get_runtime_context().get_node_id()
    other = dataclasses.replace(cfg, cpu_bytes_per_node=2 * cfg.cpu_bytes_per_node)
    other = dataclasses.replace(other, eviction_policy="arc", replicate_after_loads=0)
    with pytest.raises(ConfigMismatchError) as error:
        get_or_create_node_store(other, node)  # what an engine's worker calls
    message = str(error.value)
    assert "cpu_bytes_per_node: running 65536, this config 131072" in message
    assert "eviction_policy: running 'lru', this config 'arc'" in message
    assert "replicate_after_loads: running 2, this config 0" in message
    assert f"tierstore down --namespace {NAMESPACE}" in message
    with pytest.raises(ConfigMismatchError, match="cpu_bytes_per_node"):
        ensure_actors(other)  # what `tierstore up` and the benchmarks call
    assert _running(node) == (_as_run(cfg),) * 2  # the actors run on, with the first config


def test_keys_of_one_engine_may_differ_from_the_first(cfg: TierStoreConfig) -> None:
    ensure_actors(cfg)
    mine = dataclasses.replace(
        cfg,
        lease_ttl_s=5.0,
        lookup_timeout_ms=50.0,
        presence_max_age_ms=0.0,
        hits_from_picture=False,
        transfer_timeout_s=10.0,
    )
    node = ray.get_runtime_context().get_node_id()
    get_or_create_node_store(mine, node)
    ensure_actors(mine)
    assert _running(node) == (_as_run(cfg),) * 2


def test_up_waits_for_its_actors_with_a_deadline(cfg: TierStoreConfig, tmp_path: Path) -> None:
    """An actor that never answers (here: the Evictor, stalled) fails `tierstore up`'s
    wait after its deadline, naming the actor; it hung before."""
    handle = start_evictor_for_tests(cfg)
    ensure_actors(cfg)
    evictor = EvictorClient(handle)
    release = tmp_path / "release"
    handle.stall.remote(str(release), 120.0)
    try:
        wait_for(Path(f"{release}.stalled").exists, "the Evictor stalled", 30.0)
        started = time.monotonic()
        with pytest.raises(RemoteCallTimeout, match=r"within 1 s from Evictor\.config"):
            _wait_with_progress(cfg, [evictor.config()], "starting", timeout_s=_DEADLINE_S)
        assert time.monotonic() - started < _DEADLINE_S + _SLACK_S
    finally:
        release.touch()
