"""A real local Ray cluster for the actor tests; the actors are stopped after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tierstore.actors.bootstrap import shutdown_actors

from tests.support import LOOPBACK
from tierstore.config import TierStoreConfig

NAMESPACE = "tierstore-actor-tests"


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    import ray

    ray.init(
        address="local",
        namespace=NAMESPACE,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address=LOOPBACK,
    )
    yield
    ray.shutdown()


@pytest.fixture
def cfg(ray_local: None) -> Iterator[TierStoreConfig]:
    config = TierStoreConfig(cpu_bytes_per_node=64 * 1024, namespace=NAMESPACE)
    yield config
    shutdown_actors(NAMESPACE)
