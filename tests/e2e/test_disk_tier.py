"""The disk tier with the real engine: demotion under pressure, corruption, full restarts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tierstore.deploy.cli import collect_status, format_status
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
from tests.support import fill_filesystem, flip_bit, overwrite, small_tmpfs, wait_for
from tierstore.data.tiers.disk import chunk_records
from tierstore.store.disk_health import DISK_RETRY_MAX_S

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


# The full disk: a tmpfs of 8 MiB, filled but for 160 KiB (what tierstore's folder, its
# marker and locks need at start, and about three of Llama's 36 KiB chunk slots).
FULL_FS_MIB = 8
FULL_FS_LEFT = 160 << 10


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs (needs root to mount; skipped without)."""
    with small_tmpfs(tmp_path / "disk", FULL_FS_MIB) as root:
        yield root


def _node_store_views(namespace: str, node_id: str) -> tuple[set[Any], set[Any]]:
    """What the NodeStore holds, and what the Evictor's index believes it holds."""
    import ray
    from tierstore.actors.clients import EvictorClient
    from tierstore.actors.placement import EVICTOR_NAME, node_store_name

    from tierstore.keys import TierName
    from tierstore.wire import shard_id_of

    evictor = EvictorClient(ray.get_actor(EVICTOR_NAME, namespace=namespace))
    store = ray.get_actor(node_store_name(node_id), namespace=namespace)
    held = ray.get(store.inventory.remote(), timeout=60)
    indexed = evictor.index_view(node_id).result()
    return tuple(  # type: ignore[return-value]
        {(shard_id_of(s), TierName(t)) for s, t in copies} for copies in (held, indexed)
    )


def test_a_full_disk_costs_only_the_disk_copies_and_nothing_is_lost_once_it_frees_up(
    runs, run_engine, tiny_model, full_disk: Path
) -> None:
    """The disk tier on a nearly full tmpfs, a CPU tier with room. Before: each
    write-through that failed with ENOSPC deleted its shard from memory too, and a
    prompt stored then reloaded after a device-cache reset reloaded nothing.

    Now every prompt reloads from the CPU tier with parity, the failure is counted and the
    disk tier degraded (in ``tierstore status``), the index counts no disk copy that does
    not exist; once the disk frees up and the retry is due, a second engine's stores are
    written through again, and everything the first one stored still reloads."""
    namespace = "tierstore-e2e-disk-full"
    filler = fill_filesystem(full_disk, FULL_FS_LEFT)
    extra = tierstore_extra(
        namespace=namespace, disk_path=str(full_disk / "tier"), disk_bytes_per_node="4MiB"
    )
    engine = {**engine_for(tiny_model, "llama", "float32"), "kv_extra_config": extra}
    prompts = [PROMPT, random_prompt(1000, seed=51)]
    first = run_engine(engine, prompts, 2, reset_each=True)

    device = only(runs["llama"]["device"], 0)  # PROMPT computed without tierstore
    for i in range(len(prompts)):
        stored, reloaded = only(first, 0, i), only(first, 1, i)
        assert reloaded["num_cached_tokens"] >= MIN_CACHED_FRACTION * 1000
        assert reloaded["tokens"] == stored["tokens"]
    assert only(first, 1, 0)["tokens"] == device["tokens"]

    status = collect_status(namespace)
    (node,) = status["nodes"]
    chunks = sum(1000 // first.block_size for _ in prompts)
    assert node["cpu"]["chunks"] >= chunks  # every chunk kept in memory
    assert node["disk"]["chunks"] < chunks // 4  # the few that fitted
    assert node["stats"]["disk_write_failures"] >= 1
    assert node["stats"]["disk_writes_skipped"] >= 1
    assert node["disk"]["degraded"] and "ENOSPC" in node["disk"]["error"]
    assert status["totals"]["disk_write_failures"] == node["stats"]["disk_write_failures"]
    text = format_status(status)
    assert "DEGRADED" in text and "ENOSPC" in text
    assert f"disk writes failed {node['stats']['disk_write_failures']}" in text

    # The index counts exactly the copies the node holds: none on disk that is not there.
    def views_agree() -> bool:
        held, indexed = _node_store_views(namespace, node["node_id"])
        return held == indexed

    wait_for(views_agree, "the index and the node agree", 30)

    # The disk frees up; once the retry is due, the next stores are written through.
    filler.unlink()
    wait_for(
        lambda: collect_status(namespace)["nodes"][0]["disk"].get("retry_in_s") == 0,
        "the disk tier's retry due",
        DISK_RETRY_MAX_S + 10,
        poll_s=1.0,
    )
    failures = node["stats"]["disk_write_failures"]
    third = random_prompt(1000, seed=52)
    second = run_engine(engine, [*prompts, third], 1, reset_each=True)
    for i in range(len(prompts)):  # nothing held in memory was lost
        again = only(second, 0, i)
        assert again["num_cached_tokens"] >= MIN_CACHED_FRACTION * 1000
        assert again["tokens"] == only(first, 0, i)["tokens"]
    status = collect_status(namespace)
    (node,) = status["nodes"]
    assert not node["disk"]["degraded"]
    assert node["stats"]["disk_write_failures"] == failures
    assert node["disk"]["chunks"] >= 1000 // first.block_size  # the third prompt's
    assert node["cpu"]["chunks"] >= chunks + 1000 // first.block_size
    wait_for(views_agree, "the index and the node agree", 30)
