"""``tierstore bench soak``: vLLM's OpenAI server with tierstore under load and faults.

A ``ray.cluster_utils`` cluster (a head and two raylets on 127.0.0.1, Ray token auth on)
runs tierstore's actors; ``vllm serve`` (the OpenAI server) serves a tiny fp32 Llama with
tierstore as its KV offloader, a small CPU tier, and a disk tier on a small tmpfs of its
own. Clients (the ``openai`` package) send a mixed greedy workload while an injector
kills the Evictor and a NodeStore, removes a node, flips bytes in and tears stored
chunks, fills the disk tier's filesystem, and kills and restarts the server. Every
response is compared with the same server's answer without tierstore. Afterwards a
sweep re-sends every prompt (device cache emptied) so each corrupt file is read.

Writes ``soak.json`` with the figures; ``tests/e2e/test_soak.py`` runs ``--quick``.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstore.deploy.bench.common import percentile
from tierstore.deploy.bench.soak_load import Response, Workload
from tierstore.deploy.ray_auth import token_auth

logger = logging.getLogger(__name__)

NAMESPACE = "tierstore-soak"


@dataclass(frozen=True)
class Plan:
    workload: Workload
    concurrency: int
    cycles: int  # times through the fault schedule
    gap_s: float  # between two faults
    flips: int
    tears: int  # payload tails zeroed (a write cut short)
    tmpfs_mib: int


QUICK = Plan(Workload(conversations=12, turns=3), 4, 1, 6.0, 3, 3, 24)
FULL = Plan(Workload(conversations=32, turns=4), 6, 3, 15.0, 6, 6, 48)
SCHEDULE = (
    "kill_evictor",
    "kill_node_store",
    "remove_node",
    "corrupt_files",
    "fill_disk",
    "restart_server",
)


@contextmanager
def disk_tier_fs(root: Path, size_mib: int) -> Iterator[bool]:
    """A tmpfs of ``size_mib`` at ``root`` (needs root); yields whether it is mounted. Without
    it the disk tier lives on the machine's own disk and the fill fault is skipped."""
    root.mkdir(parents=True, exist_ok=True)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(root)],
            capture_output=True,
        ).returncode
        == 0
    )
    if not mounted:
        logger.warning("no tmpfs at %s (not root?): the disk-full fault is skipped", root)
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(root)], capture_output=True)


@contextmanager
def soak_cluster(workers: int) -> Iterator[Any]:
    """A head (no CPUs for tasks) and ``workers`` one-CPU raylets on loopback; this
    process is its driver. Node loss is declared in ~5 s (Ray's default: ~30 s)."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_worker_niceness", "0")  # what tierstore's `ray start` sets
    health = {
        "health_check_period_ms": 1000,
        "health_check_timeout_ms": 1000,
        "health_check_failure_threshold": 5,
    }
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "_system_config": health},
    )
    for _ in range(workers):
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def store_extra(root: Path, quick: bool) -> dict[str, Any]:
    """A CPU tier of a few prompts, so most chunks go to disk; the disk budget is the
    whole tmpfs (tierstore refuses a larger one), so the fill fault's file fills the
    filesystem before tierstore's own limit."""
    from tierstore.deploy.passes import TIERSTORE_SPEC

    return {
        **TIERSTORE_SPEC,
        "namespace": NAMESPACE,
        "cpu_bytes_per_node": "2MiB",
        "disk_path": str(root),
        "disk_bytes_per_node": f"{(QUICK if quick else FULL).tmpfs_mib}MiB",
    }


def compare(responses: list[Response], reference: dict[tuple[int, ...], Response]) -> dict:
    """Served responses against the reference's answer to the same prompt."""
    served = [r for r in responses if r.error is None]
    wrong, unmatched, diff = 0, 0, 0.0
    for r in served:
        ref = reference.get(tuple(r.prompt))
        if ref is None:
            unmatched += 1  # an earlier turn's output differed, so this prompt did too
            continue
        wrong += r.tokens != ref.tokens
        if r.tokens == ref.tokens and r.logprobs and ref.logprobs:
            diff = max(diff, *(abs(a - b) for a, b in zip(r.logprobs, ref.logprobs, strict=True)))
    return {
        "requests_sent": len(responses),
        "attempts": sum(r.attempts for r in responses),
        "served": len(served),
        "failed": len(responses) - len(served),
        "wrong_outputs": wrong + unmatched,
        "prompts_without_reference": unmatched,
        "max_logprob_diff": diff,
        "cached_tokens": sum(r.cached_tokens for r in served),
        "prompt_tokens": sum(len(r.prompt) for r in served),
    }


def ttfts(responses: list[Response]) -> dict[str, float]:
    times = [r.ttft_s for r in responses if r.error is None] or [0.0]
    waits = [r.wait_s for r in responses if r.error is None] or [0.0]
    return {"ttft_p50_s": percentile(times, 50), "ttft_max_s": max(times), "wait_max_s": max(waits)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    token_auth(force=True)  # a token the caller gave is kept
    for client_log in ("httpx", "httpx2"):  # a line per request otherwise
        logging.getLogger(client_log).setLevel(logging.WARNING)
    from tierstore.deploy.bench.soak_run import soak

    return soak(args, QUICK if args.quick else FULL)
