"""A real local Ray cluster for the actor tests; the actors are stopped after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tierstore.actors.bootstrap import shutdown_actors

from tests.support import init_local_ray
from tierstore.config import TierStoreConfig

NAMESPACE = "tierstore-actor-tests"


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    import ray

    init_local_ray(NAMESPACE)
    yield
    ray.shutdown()


@pytest.fixture
def cfg(ray_local: None) -> Iterator[TierStoreConfig]:
    config = TierStoreConfig(cpu_bytes_per_node=64 * 1024, namespace=NAMESPACE)
    yield config
    shutdown_actors(NAMESPACE)
