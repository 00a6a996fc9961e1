"""The arena's shared mapping on real files: owner-only, shared with workers, replaced on
restart, and a file-backed fallback when /dev/shm is short of room."""

from __future__ import annotations

import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierstore.data.arena.region import (
    SHM_DIR,
    ArenaError,
    ArenaMapping,
    ArenaRegion,
    RegionInfo,
    arena_file_name,
)

MiB = 1 << 20


@pytest.fixture
def node() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def regions() -> Iterator[list[ArenaRegion]]:
    made: list[ArenaRegion] = []
    yield made
    for region in made:
        region.close()


def test_arena_in_shm_is_private_shared_and_unlinked_on_close(
    node: str, regions: list[ArenaRegion]
) -> None:
    region = ArenaRegion.create("ns-test", node, 3 * MiB + 5)
    regions.append(region)
    path = SHM_DIR / arena_file_name("ns-test", node)
    assert region.path == path and path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
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
    first = ArenaRegion.create("ns-test", node, MiB)
    first.view(0, 8)[:] = 7
    # The NodeStore dies without closing: its file stays. Its successor starts empty.
    second = ArenaRegion.create("ns-test", node, MiB)
    regions.append(second)
    assert second.info.epoch != first.info.epoch
    assert not second.array.any()
    assert first.view(0, 8).tolist() == [7] * 8  # the dead one's pages are its own
    with pytest.raises(ArenaError, match="bytes"):
        ArenaMapping(RegionInfo(second.info.path, MiB * 2, second.info.epoch))


def test_small_shm_falls_back_to_a_file_backed_arena(
    node: str, tmp_path: Path, regions: list[ArenaRegion]
) -> None:
    region = ArenaRegion.create(
        "ns-test", node, 2 * MiB, fallback_dir=tmp_path / "arena", shm_free_bytes=64 * 1024
    )
    regions.append(region)
    assert region.path.parent == tmp_path / "arena"
    assert not (SHM_DIR / arena_file_name("ns-test", node)).exists()
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
