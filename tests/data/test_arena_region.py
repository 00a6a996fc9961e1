"""The arena's shared mapping on real files: owner-only, in this user's private directory,
shared with workers, replaced on restart (never while its NodeStore lives), and a
file-backed fallback when /dev/shm is short of room."""

from __future__ import annotations

import dataclasses
import os
import signal
import stat
from pathlib import Path

import numpy as np
import pytest

from tests.support import nodestore_process
from tierstore.data.arena.region import (
    SHM_DIR,
    ArenaError,
    ArenaMapping,
    ArenaRegion,
    arena_dir,
    arena_file_name,
)

MiB = 1 << 20


def test_arena_in_shm_is_private_shared_and_unlinked_on_close(
    node: str, regions: list[ArenaRegion]
) -> None:
    region = ArenaRegion.create("ns-test", node, 3 * MiB + 5)
    regions.append(region)
    path = SHM_DIR / f"tierstore-{os.geteuid()}" / arena_file_name("ns-test", node)
    assert region.path == path and path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(path.parent).st_mode) == 0o700
    assert region.nbytes % 4096 == 0 and region.nbytes >= 3 * MiB + 5
    assert region.address % 4096 == 0
    worker = ArenaMapping(region.info)
    worker.view(MiB, 4)[:] = [1, 2, 3, 4]  # a worker writes, the owner sees it
    assert region.view(MiB, 4).tolist() == [1, 2, 3, 4]
    worker.close()
    region.close()
    assert not path.exists()
    region.close()  # idempotent


def test_restart_replaces_a_stale_arena_with_an_empty_one(
    node: str, regions: list[ArenaRegion]
) -> None:
    proc, first = nodestore_process("ns-test", node, MiB)
    try:
        dead = ArenaMapping(first)  # a worker still mapping the dead NodeStore's arena
    finally:
        proc.send_signal(signal.SIGKILL)  # dies without closing: its file stays
        proc.wait()
    assert Path(first.path).exists()
    second = ArenaRegion.create("ns-test", node, MiB, held_wait_s=5)
    regions.append(second)
    assert second.info.path == first.path and second.info.epoch != first.epoch
    assert second.info.inode != first.inode
    assert not second.array.any()  # the successor starts empty
    assert dead.view(0, 8).tolist() == [7] * 8  # the dead one's pages are its own
    assert dead.replaced()
    dead.close()
    with pytest.raises(ArenaError, match="bytes"):
        ArenaMapping(dataclasses.replace(second.info, nbytes=MiB * 2))


def test_small_shm_falls_back_to_a_file_backed_arena(
    node: str, tmp_path: Path, regions: list[ArenaRegion]
) -> None:
    region = ArenaRegion.create(
        "ns-test", node, 2 * MiB, fallback_dir=tmp_path / "arena", shm_free_bytes=64 * 1024
    )
    regions.append(region)
    assert region.path.parent == tmp_path / "arena" / f"tierstore-{os.geteuid()}"
    assert stat.S_IMODE(os.lstat(region.path.parent).st_mode) == 0o700
    assert not (arena_dir(SHM_DIR) / arena_file_name("ns-test", node)).exists()
    worker = ArenaMapping(region.info)
    worker.view(5, 3)[:] = 9
    assert region.view(5, 3).tolist() == [9, 9, 9]
    worker.close()


def test_no_room_anywhere_names_the_setting_and_the_mounts(node: str, tmp_path: Path) -> None:
    with pytest.raises(ArenaError, match="cpu_bytes_per_node") as err:
        ArenaRegion.create("ns-test", node, 2 * MiB, shm_free_bytes=MiB)
    assert str(SHM_DIR) in str(err.value)
    with pytest.raises(ArenaError, match=str(tmp_path)):
        ArenaRegion.create("ns-test", node, 1 << 60, fallback_dir=tmp_path, shm_free_bytes=MiB)


def test_views_outside_the_arena_are_refused(node: str, regions: list[ArenaRegion]) -> None:
    region = ArenaRegion.create("ns-test", node, MiB)
    regions.append(region)
    with pytest.raises(ValueError, match="outside"):
        region.view(MiB - 2, 4)
    assert isinstance(region.view(0, 0), np.ndarray)
