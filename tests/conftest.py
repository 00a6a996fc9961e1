"""Test-wide settings, inherited by every process the tests start (`ray start`, engines,
benchmarks): Ray's auth mode is set explicitly (Ray 2.60 turns token auth on), and every
Ray cluster listens on loopback only.

Ray 2.60 binds its servers (GCS, raylets, workers, agents) to the node's IP, and turns a
``127.0.0.1`` given as ``_node_ip_address`` or ``--node-ip-address`` into the machine's
routable IP (``resolve_ip_for_localhost``); so does a driver's ``address=127.0.0.1:port``.
With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` its node IP detection answers 127.0.0.1
instead (what it does on macOS and Windows). Ray reads it when it is imported: before any
test module imports Ray.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
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
