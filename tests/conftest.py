"""Test-wide settings, inherited by every process the tests start (`ray start`,
``ray.cluster_utils`` nodes, engines, `ray job submit`, `tierstore` runs, benchmarks):
Ray's token authentication is on, as Ray 2.60 runs by default, and every Ray cluster
listens on loopback only.

Token auth: ``RAY_AUTH_MODE=token`` and a random ``RAY_AUTH_TOKEN`` for this session, in
the environment only (``tierstore.deploy.ray_auth``): no token file, nothing in ~/.ray.
A caller's own choice is kept (``RAY_AUTH_MODE=disabled``, or a token of theirs in
``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``). tests/deploy/test_auth.py shows that a
client without the token is refused.

Loopback: Ray 2.60 binds its servers (GCS, raylets, workers, agents) to the node's IP,
and turns a ``127.0.0.1`` given as ``_node_ip_address`` or ``--node-ip-address`` into the
machine's routable IP (``resolve_ip_for_localhost``); so does a driver's
``address=127.0.0.1:port``. With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` its node IP
detection answers 127.0.0.1 instead (what it does on macOS and Windows).

Ray reads both when it is imported or starts a node: set before any test module imports
Ray.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierstore.deploy.ray_auth import token_auth

token_auth()
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


# Other test runs on this machine create arenas too; a file is locked microseconds after
# it is created, so a few seconds of age is ample.
_SWEEP_AGE_S = 5.0


@pytest.fixture(autouse=True, scope="module")
def _free_orphaned_arenas() -> Iterator[None]:
    """After each module: a cluster the module killed leaves its NodeStores' arenas in
    /dev/shm (a killed actor runs no shutdown hook; the next NodeStore to start on this
    machine would sweep them), ~1.3 GiB of memory each. Remove every tierstore arena or
    holder file whose lock nobody holds, with the library's own sweep, so a whole run
    does not pile them up."""
    yield
    from tierstore.data.arena.orphans import sweep_orphans

    # Younger files are left for the next module: one may be a moment from its lock.
    sweep_orphans(Path("/dev/shm"), min_age_s=_SWEEP_AGE_S)
