"""The disk tier behind the real actors: demotion, promotion, restarts, corruption."""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from tierstore.actors.bootstrap import get_or_create_evictor, shutdown_actors
from tierstore.deploy.cli import collect_status
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from tests.actors.hooks import disk_locations
from tests.actors.test_arena_actor import _node_store
from tests.support import flip_bit, overwrite, poll
from tests.vllm.test_worker_roundtrip import NS, _drain, _keys, _kv, _load_spec, _lookup, _worker
from tierstore.config import TierStoreConfig
from tierstore.data.arena.holders import HolderLock
from tierstore.data.tiers.disk import chunk_records
from tierstore.data.tiers.disk_folder import FOLDER_NAME
from tierstore.vllm.transfer_specs import StoreSpec
from tierstore.wire import LookupState

CHUNK = 2 * 96  # one chunk of group 0 in the shared test layout


@pytest.fixture
def disk_cfg(cfg: TierStoreConfig, tmp_path: Path) -> Iterator[TierStoreConfig]:
    yield dataclasses.replace(
        cfg,
        cpu_bytes_per_node=4 * CHUNK,
        disk_path=str(tmp_path / "disk"),
        disk_bytes_per_node=64 * CHUNK,
        cpu_high_watermark=1.0,
        cpu_low_watermark=1.0,
    )


def _store_chunks(worker, n: int, start: int = 0) -> list:  # type: ignore[no-untyped-def]
    keys = []
    for i in range(start, start + n):
        (key,) = _keys(1, 0, start=i)
        src = GPULoadStoreSpec([1 + i % 8, 2 + i % 8], group_sizes=[2, 0], block_indices=[0, 0])
        worker.submit_store(1000 + i, src, StoreSpec(NS, (key,)))
        keys.append(key)
    assert len(_drain(worker, n)) == n
    return keys


def _wait_status(cfg: TierStoreConfig, check, timeout: float = 10.0) -> dict:  # type: ignore[no-untyped-def]
    return poll(lambda: collect_status(cfg.namespace), timeout, done=check)


def test_cold_chunks_go_to_disk_and_come_back_exact(disk_cfg: TierStoreConfig) -> None:
    kv = _kv()
    original = kv[0].clone()
    worker = _worker(disk_cfg, kv)
    keys = _store_chunks(worker, 10)
    status = _wait_status(disk_cfg, lambda s: s["nodes"][0]["disk"]["chunks"] == 10)
    node = status["nodes"][0]
    # Every store was written through; memory keeps the 4 that fit.
    assert node["cpu"]["chunks"] == 4 and node["disk"]["chunks"] == 10
    assert node["disk"]["used_bytes"] == 10 * CHUNK
    assert len(list(chunk_records(Path(disk_cfg.disk_path)))) == 10

    # The oldest chunk is on disk: a HIT at once (promoted meanwhile), and it loads exact
    # from whichever copy the load finds.
    spec = _load_spec(disk_cfg, keys[:1])
    kv[0].zero_()
    dst = GPULoadStoreSpec([30, 31], group_sizes=[2, 0], block_indices=[0, 0])
    worker.submit_load(1, spec, dst)
    assert _drain(worker, 1) == [1]
    assert torch.equal(kv[0][30:32, :96], original[1:3, :96])
    # The promotion is one-way from the Evictor's lookup: it may land after the load.
    promoted = poll(
        lambda: collect_status(disk_cfg.namespace)["totals"]["promoted_shards"], 10, done=bool
    )
    assert promoted >= 1


def test_chunks_on_disk_survive_a_restart_of_every_actor(disk_cfg: TierStoreConfig) -> None:
    worker = _worker(disk_cfg, _kv())
    keys = _store_chunks(worker, 10)
    _wait_status(disk_cfg, lambda s: s["nodes"][0]["disk"]["chunks"] == 10)
    shutdown_actors(disk_cfg.namespace)  # Evictor and NodeStore gone: the index is lost

    _worker(disk_cfg, _kv())  # starts fresh actors on the same disk_path, waits for them
    status = collect_status(disk_cfg.namespace)
    assert status["nodes"][0]["disk"]["chunks"] == 10
    assert status["totals"]["indexed_chunks"] == 10
    # Found at start-up, never read since: verified by its promotion before a HIT.
    assert _lookup(disk_cfg, keys[:1]) == [LookupState.PENDING]
    _load_spec(disk_cfg, keys[:4])  # as many as the CPU tier holds hit again at once
    evictor = get_or_create_evictor(disk_cfg)
    ray.get(evictor.release_holder.remote("test"))
    _load_spec(disk_cfg, keys[4:8])  # and more, once the first ones may go back down


def test_the_node_store_writes_only_in_its_own_folder_of_disk_path(
    disk_cfg: TierStoreConfig, tmp_path: Path
) -> None:
    """What the user keeps in disk_path, and symlinks planted where the layout before
    tierstore's folder kept its lock and slabs, are untouched through stores and a
    restart of every actor; disk_path's mode too."""
    disk = Path(disk_cfg.disk_path)
    (disk / NS).mkdir(parents=True, mode=0o755)
    disk.chmod(0o755)
    victim = tmp_path / "victim"
    victim.write_bytes(b"not tierstore's")
    (disk / ".lock").symlink_to(victim)
    (disk / NS / f"{CHUNK // 2}.slab").symlink_to(victim)
    (disk / NS / f"{CHUNK}.slab").symlink_to(victim)
    (disk / "notes.txt").write_bytes(b"the user's")
    os.chmod(disk / "notes.txt", 0o644)
    before = sorted((p.name, os.lstat(p).st_mode) for p in disk.rglob("*"))

    worker = _worker(disk_cfg, _kv())
    _store_chunks(worker, 10)
    _wait_status(disk_cfg, lambda s: s["nodes"][0]["disk"]["chunks"] == 10)
    shutdown_actors(disk_cfg.namespace)
    _worker(disk_cfg, _kv())
    assert collect_status(disk_cfg.namespace)["nodes"][0]["disk"]["chunks"] == 10

    assert victim.read_bytes() == b"not tierstore's"
    assert (disk / "notes.txt").read_bytes() == b"the user's"
    assert stat.S_IMODE(disk.stat().st_mode) == 0o755
    after = sorted(
        (p.name, os.lstat(p).st_mode)
        for p in disk.rglob("*")
        if FOLDER_NAME not in p.relative_to(disk).parts
    )
    assert after == before
    assert {r.location.path.parent.parent for r in chunk_records(disk)} == {disk / FOLDER_NAME}


def test_flipped_and_torn_chunks_become_misses_and_are_counted(
    disk_cfg: TierStoreConfig,
) -> None:
    worker = _worker(disk_cfg, _kv())
    keys = _store_chunks(worker, 10)
    _wait_status(disk_cfg, lambda s: s["nodes"][0]["disk"]["chunks"] == 10)
    where = disk_locations(Path(disk_cfg.disk_path))
    flipped, torn = (where[k] for k in keys[:2])
    end = flipped.payload_offset + flipped.nbytes
    flip_bit(flipped.path, end - 1, 0x40)  # the payload's last byte
    # A write cut short: the payload's tail never landed.
    end = torn.payload_offset + torn.nbytes
    assert overwrite(torn.path, end - 8, bytes(8)) != bytes(8)

    states = poll(
        lambda: _lookup(disk_cfg, keys[:2]),
        10,
        poll_s=0.02,
        done=lambda s: s == [LookupState.MISS, LookupState.MISS],
    )
    assert states == [LookupState.MISS, LookupState.MISS]
    status = collect_status(disk_cfg.namespace)
    assert status["totals"]["corrupt_before_hit"] == 2
    assert status["nodes"][0]["stats"]["corrupt_before_hit"] == 2
    evictor = get_or_create_evictor(disk_cfg)
    assert ray.get(evictor.status.remote())["chunks"] == 8
    on_disk = [bytes(r.header["key"]) for r in chunk_records(Path(disk_cfg.disk_path))]
    assert len(on_disk) == 8 and not {bytes(k) for k in keys[:2]} & set(on_disk)


def test_a_promotion_with_no_free_extent_keeps_the_disk_copy_and_loads_from_disk(
    disk_cfg: TierStoreConfig,
) -> None:
    """Extents granted to workers are room the Evictor does not see: the NodeStore refuses
    the promotion it asked for, and the chunk stays on disk, a HIT loaded from there."""
    # Demoted down to half the CPU tier: the Evictor sees room for a promotion.
    cfg = dataclasses.replace(disk_cfg, cpu_high_watermark=0.5, cpu_low_watermark=0.5)
    kv = _kv()
    original = kv[0].clone()
    worker = _worker(cfg, kv)
    keys = _store_chunks(worker, 10)
    _wait_status(cfg, lambda s: s["nodes"][0]["disk"]["chunks"] == 10)
    store = _node_store(cfg)
    region, _ = store.arena_info().result()
    hog = HolderLock(region.path)  # another worker's pool takes every free extent
    for _ in range(100):
        _, offsets = store.arena_grant(hog.holder, region.epoch, [CHUNK] * 16).result()
        if None in offsets:
            break
    assert store.status().result()["arena"]["arena_free_bytes"] < CHUNK

    spec = _load_spec(cfg, keys[:1])  # the oldest: on disk only, a HIT at once
    status = _wait_status(cfg, lambda s: s["totals"]["refused_promotions"] >= 1)
    assert status["totals"]["refused_promotions"] >= 1
    assert status["nodes"][0]["stats"]["refused_promotions"] >= 1
    assert status["totals"]["corrupt_before_hit"] == 0
    assert status["nodes"][0]["disk"]["chunks"] == 10  # nothing dropped
    kv[0].zero_()
    worker.submit_load(
        1, spec, GPULoadStoreSpec([30, 31], group_sizes=[2, 0], block_indices=[0, 0])
    )
    assert _drain(worker, 1) == [1]
    assert torch.equal(kv[0][30:32, :96], original[1:3, :96])
    assert _lookup(cfg, keys[:1]) == [LookupState.HIT]  # still indexed

    hog.close()  # the hog's grants come back at the next grant; then it is promoted
    sweeper = HolderLock(region.path)
    store.arena_grant(sweeper.holder, region.epoch, []).result()
    sweeper.close()
    _load_spec(cfg, keys[:1])
    totals = _wait_status(cfg, lambda s: s["totals"]["promoted_shards"] >= 1)["totals"]
    assert totals["promoted_shards"] >= 1
