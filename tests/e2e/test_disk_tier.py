"""The disk tier with the real engine: demotion under pressure, corruption, full restarts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tierstore.deploy.cli import collect_status
from tierstore.deploy.passes import random_prompt

from tests.e2e.conftest import (
    FP32_LOGPROB_TOL,
    MIN_CACHED_FRACTION,
    PROMPT,
    engine_for,
    max_logprob_diff,
    only,
    tierstore_extra,
)
from tests.support import flip_bit, overwrite
from tierstore.data.tiers.disk import chunk_records

pytestmark = pytest.mark.e2e

# PROMPT first, then two more: together ~3x what the CPU tier holds, so PROMPT's chunks
# are demoted before pass 2 needs them again.
PROMPTS = [PROMPT, random_prompt(1000, seed=31), random_prompt(1000, seed=32)]
# Llama's chunks (fp32, one 32-token block) are 32 KiB: four of them, where PROMPT has 31.
SMALL_CPU_BYTES = 128 << 10


def _disk_extra(namespace: str, disk_path: Path, cpu_bytes: int | str) -> dict[str, Any]:
    return tierstore_extra(
        namespace=namespace,
        cpu_bytes_per_node=cpu_bytes,
        disk_path=str(disk_path),
        disk_bytes_per_node="256MiB",
    )


@pytest.mark.parametrize(("name", "dtype"), [("gemma3", "float32"), ("qwen3-next", "bfloat16")])
def test_prompts_larger_than_the_cpu_tier_hit_from_disk_with_parity(
    runs, run_engine, tiny_model, tmp_path: Path, name: str, dtype: str
) -> None:
    namespace = f"tierstore-e2e-disk-{name}"
    extra = _disk_extra(namespace, tmp_path / "disk", "2MiB")
    passes = run_engine(
        {**engine_for(tiny_model, name, dtype), "kv_extra_config": extra},
        PROMPTS,
        2,
        reset_each=True,
    )
    status = collect_status(namespace)
    (node,) = status["nodes"]
    assert node["cpu"]["used_bytes"] <= node["cpu"]["capacity_bytes"] == 2 << 20
    assert status["totals"]["demoted_shards"] > 0
    assert status["totals"]["promoted_shards"] > 0  # pass 2 needed chunks back from disk
    assert node["disk"]["chunks"] > node["cpu"]["chunks"]

    restored = only(passes, 1, request=0)
    assert restored["num_cached_tokens"] >= MIN_CACHED_FRACTION * len(PROMPT)
    # Same hit boundary and bytes as the reference restore of PROMPT: identical output.
    reference = only(runs[name]["reference"], 1)
    assert restored["num_cached_tokens"] == reference["num_cached_tokens"]
    assert restored["tokens"] == reference["tokens"]
    assert restored["logprobs"] == reference["logprobs"]
    assert restored["tokens"] == only(runs[name]["device"], 1)["tokens"]
    for i in range(len(PROMPTS)):
        assert only(passes, 1, i)["tokens"] == only(passes, 0, i)["tokens"]
        assert only(passes, 1, i)["num_cached_tokens"] >= MIN_CACHED_FRACTION * 1000


def test_a_prompt_larger_than_the_whole_cpu_tier_hits_from_disk(
    runs, run_engine, tiny_model, tmp_path: Path
) -> None:
    """A CPU tier of 4 chunks, a prompt of 31: pass 2 reloads the whole prompt, most of it
    straight from disk (its own leased chunks hold the room a promotion would need), with
    the reference restore's hit boundary, tokens and log-probs. Before: 4 chunks were
    stored (the batch's own chunks held the room) and 128 of 1,000 tokens reloaded."""
    namespace = "tierstore-e2e-disk-small-cpu"
    extra = _disk_extra(namespace, tmp_path / "disk", SMALL_CPU_BYTES)
    passes = run_engine(
        {**engine_for(tiny_model, "llama", "float32"), "kv_extra_config": extra}, [PROMPT], 2
    )
    status = collect_status(namespace)
    (node,) = status["nodes"]
    assert node["cpu"]["used_bytes"] <= node["cpu"]["capacity_bytes"] == SMALL_CPU_BYTES
    # Stored whole (its head demoted to disk as its tail arrived), none of it skipped...
    assert node["disk"]["chunks"] >= len(PROMPT) // passes.block_size > 2 * node["cpu"]["chunks"]
    assert status["totals"]["skipped_stores"] == 0
    # ...and read back straight from disk: no CPU room to promote it into.
    assert status["totals"]["disk_hits"] > 0

    restored = only(passes, 1)
    reference = only(runs["llama"]["reference"], 1)
    assert restored["num_cached_tokens"] == reference["num_cached_tokens"]
    assert restored["num_cached_tokens"] >= MIN_CACHED_FRACTION * len(PROMPT)
    assert restored["tokens"] == reference["tokens"] == only(passes, 0)["tokens"]
    assert restored["logprobs"] == reference["logprobs"]


@pytest.fixture
def separate_cluster() -> Iterator[Any]:
    """Start and stop whole Ray clusters of our own (the session's one stays up)."""
    keepers: list[subprocess.Popen[str]] = []

    def start() -> str:
        keeper = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import ray, sys\n"
                "ray.init(address='local', include_dashboard=False, _node_ip_address='127.0.0.1')\n"
                "print(ray.get_runtime_context().gcs_address, flush=True)\n"
                "sys.stdin.read()\n",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ},
        )
        keepers.append(keeper)
        assert keeper.stdout is not None
        return keeper.stdout.readline().strip()

    def stop() -> None:
        keeper = keepers.pop()
        assert keeper.stdin is not None
        keeper.stdin.close()  # the keeper's ray.shutdown() takes every actor down with it
        keeper.wait(timeout=60)

    yield start, stop
    while keepers:
        stop()


def test_restart_keeps_prefixes_and_corrupt_files_are_never_served(
    run_engine, tiny_model, tmp_path: Path, separate_cluster: Any
) -> None:
    start, stop = separate_cluster
    disk = tmp_path / "disk"
    prompts = [random_prompt(1000, seed=s) for s in (41, 42, 43)]
    engine = {
        **engine_for(tiny_model, "llama", "float32"),
        "kv_extra_config": _disk_extra("tierstore-e2e-restart", disk, "1GiB"),
    }
    first = run_engine(engine, prompts, 1, reset_each=True, ray_address=start())
    stop()  # the whole cluster: Evictor, NodeStore and the object store are gone

    # Each prompt's first chunk is the root of its chain (no parent in its header).
    roots = [r for r in chunk_records(disk) if r.header["parent"] is None]
    assert len(roots) == len(prompts)
    flipped, torn, intact = (r.location for r in roots)
    flip_bit(flipped.path, flipped.payload_offset + flipped.nbytes - 100)
    half = torn.nbytes // 2  # a write cut short: the payload's second half never landed
    overwrite(torn.path, torn.payload_offset + half, bytes(torn.nbytes - half))

    address = start()
    second = run_engine(engine, prompts, 1, reset_each=True, ray_address=address)
    cached = sorted(only(second, 0, i)["num_cached_tokens"] for i in range(len(prompts)))
    # The two corrupt roots make their prompts recompute; the third hits from disk.
    assert cached[:2] == [0, 0]
    assert cached[2] >= MIN_CACHED_FRACTION * 1000
    for i in range(len(prompts)):
        before, after = only(first, 0, i), only(second, 0, i)
        assert after["tokens"] == before["tokens"]
        assert max_logprob_diff(after, before) <= FP32_LOGPROB_TOL
    status = _status_of(address, "tierstore-e2e-restart")
    assert status["totals"]["corrupt_before_hit"] == 2
    # The corrupt chunks were freed; the recomputed ones may since have been stored again,
    # but nothing on disk fails its checksum, and the intact root is where it was.
    records = list(chunk_records(disk))
    assert records and all(r.payload_ok() for r in records)
    assert any(r.location == intact and r.header == roots[2].header for r in records)


def _status_of(address: str, namespace: str) -> dict[str, Any]:
    """`tierstore status --json` against another cluster, as an operator would run it."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.deploy.cli",
            "status",
            "--json",
            "--address",
            address,
            "--namespace",
            namespace,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    import json

    return json.loads(out.stdout)
