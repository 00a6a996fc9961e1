"""A failed disk write costs only the disk copy: NodeStoreCore over a real disk tier on a
tmpfs filled to its last pages (ENOSPC from the kernel, no mock of the disk), and the
degraded state's backoff on a clock the test moves.

Mounting a tmpfs needs root; without it these tests skip (the backoff tests run anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support import Answered, fill_filesystem, small_tmpfs
from tierstore.control.index import NodeActions
from tierstore.data.checksum import digest
from tierstore.data.tiers.disk import DiskTier
from tierstore.data.tiers.memory import MemoryTier
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName
from tierstore.store.disk_health import DISK_RETRY_FIRST_S, DISK_RETRY_MAX_S, DiskHealth
from tierstore.store.node_store import NodeStoreCore
from tierstore.wire import ShardEntry, UnitOffer

NS = Namespace("d15c")
NODE = NodeId("n1")
SHARD = 4096  # a slot of two pages: its header and its payload
FS_MIB = 1
LEFT_FREE = 3 * 2 * 4096  # room for three shards' slots once the filesystem is filled


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class WriteThroughEvictor:
    """The EvictorPort: admits every offer and asks for its write-through (a node with a
    disk); records the one-way reports."""

    def __init__(self) -> None:
        self.forgotten: list[ShardId] = []
        self.reports: list[tuple[list[ShardId], int, bool]] = []

    def admit_units(
        self, node_id: NodeId, units: list[UnitOffer]
    ) -> Answered[tuple[list[list[bool]], NodeActions]]:
        persist = [ShardId(o.namespace, o.key, o.rank) for u in units for o in u.shards]
        return Answered(([[True] * len(u.shards) for u in units], NodeActions(persist=persist)))

    def restore(self, node_id, held, grace=False):  # type: ignore[no-untyped-def]
        return Answered(([True] * len(held), NodeActions()))

    def promoted(self, node_id, done, failed, refused) -> None:  # type: ignore[no-untyped-def]
        pass

    def forget_shards(self, node_id: NodeId, shard_ids: list[ShardId]) -> None:
        self.forgotten += shard_ids

    def report_corrupt_after_hit(self, node_id: NodeId, shard_ids: list[ShardId]) -> None:
        raise AssertionError(f"no shard is corrupt, yet {shard_ids} was reported")

    def replicated(self, node_id, done, failed) -> None:  # type: ignore[no-untyped-def]
        pass

    def report_disk_writes(
        self, node_id: NodeId, unwritten: list[ShardId], failures: int, writable: bool
    ) -> None:
        self.reports.append((list(unwritten), failures, writable))

    @property
    def unwritten(self) -> list[ShardId]:
        return [s for unwritten, _, _ in self.reports for s in unwritten]


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\0")


def _bytes(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SHARD, dtype=np.uint8)


def _sid(i: int) -> ShardId:
    return ShardId(NS, _key(i), 0)


def _store(core: NodeStoreCore, i: int) -> None:
    data = _bytes(i)
    assert core.store(NS, 0, 1, [ShardEntry(_key(i), 0, SHARD, digest(data), 1)], data) == 1


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root; skipped without)."""
    with small_tmpfs(tmp_path / "fs", FS_MIB) as root:
        yield root


def test_a_full_disk_costs_only_the_disk_copies_and_writes_resume_once_it_frees_up(
    full_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: each write-through that failed with ENOSPC deleted its shard from memory
    too (15 of 20 shards vanished from a CPU tier with room)."""
    disk = DiskTier(full_fs / "disk", 512 << 10)  # its files made while there is room
    clock = Clock()
    evictor = WriteThroughEvictor()
    core = NodeStoreCore(NODE, MemoryTier(1 << 20), disk, evictor, clock=clock)
    filler = fill_filesystem(full_fs, LEFT_FREE)

    with caplog.at_level(logging.WARNING, logger="tierstore"):
        for i in range(20):
            _store(core, i)
    # Every shard stays in memory, loads and verifies (the load checks its digest).
    data, metas = core.load(NS, 0, [_key(i) for i in range(20)])
    assert bytes(data) == b"".join(bytes(_bytes(i)) for i in range(20))
    assert [m.digest for m in metas] == [digest(_bytes(i)) for i in range(20)]
    on_disk = [i for i in range(20) if _sid(i) in disk]
    assert 0 < len(on_disk) < 20 and on_disk == list(range(len(on_disk)))
    # One write failed; then the tier was degraded and the rest were not tried.
    stats = core.status()["stats"]
    assert stats["disk_write_failures"] == 1
    assert stats["disk_writes_skipped"] == 20 - len(on_disk) - 1
    state = core.status()["disk"]
    assert state["degraded"] and "ENOSPC" in state["error"]
    assert state["retry_in_s"] == DISK_RETRY_FIRST_S
    # One warning for the degraded period, with the errno and the mount.
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("tierstore.store")
    ]
    assert len(warnings) == 1 and "ENOSPC" in warnings[0] and str(full_fs) in warnings[0]
    # The Evictor heard the truth: these shards have no disk copy, one write failed, and
    # the tier takes no writes for now.
    assert evictor.unwritten == [_sid(i) for i in range(len(on_disk), 20)]
    assert sum(failures for _, failures, _ in evictor.reports) == 1
    assert evictor.reports[-1][2] is False
    assert not evictor.forgotten
    held = core.inventory()
    assert all((_sid(i), TierName.CPU) in held for i in range(20))

    # A demotion that needs a write is refused while degraded: the shard is dropped and
    # the Evictor told (the policy chose to evict it), never lost silently.
    core.apply(NodeActions(demote=[_sid(19)]))
    assert evictor.forgotten == [_sid(19)] and _sid(19) not in core.cpu
    assert core.status()["stats"]["failed_demotions"] == 1
    # One already on disk demotes for free.
    core.apply(NodeActions(demote=[_sid(0)]))
    assert _sid(0) not in core.cpu and _sid(0) in disk
    assert core.load(NS, 0, [_key(0)])[1][0].digest == digest(_bytes(0))

    # The disk frees up; once the retry is due, the next store tells the Evictor the tier
    # takes writes again, and its write-through lands.
    filler.unlink()
    _store(core, 20)
    assert _sid(20) not in disk  # the retry is not due yet
    clock.now += DISK_RETRY_FIRST_S
    _store(core, 21)
    assert _sid(21) in disk and not core.status()["disk"]["degraded"]
    assert evictor.reports[-1][2] is True
    assert core.status()["stats"]["disk_write_failures"] == 1
    # Nothing held in memory was lost; an old memory-only shard now demotes to disk.
    kept = [i for i in range(1, 22) if i != 19]
    data, _ = core.load(NS, 0, [_key(i) for i in kept])
    assert bytes(data) == b"".join(bytes(_bytes(i)) for i in kept)
    core.apply(NodeActions(demote=[_sid(18)]))
    assert _sid(18) in disk and _sid(18) not in core.cpu
    assert disk.get(_sid(18)).meta.digest == digest(_bytes(18))


def test_a_failed_retry_keeps_the_tier_degraded_and_waits_longer(full_fs: Path) -> None:
    disk = DiskTier(full_fs / "disk", 512 << 10)
    clock = Clock()
    evictor = WriteThroughEvictor()
    core = NodeStoreCore(NODE, MemoryTier(1 << 20), disk, evictor, clock=clock)
    fill_filesystem(full_fs, 0)
    _store(core, 0)
    _store(core, 1)
    assert core.status()["stats"]["disk_write_failures"] == 1
    clock.now += DISK_RETRY_FIRST_S
    _store(core, 2)  # the retry: still full
    stats, state = core.status()["stats"], core.status()["disk"]
    assert stats["disk_write_failures"] == 2 and stats["disk_writes_skipped"] == 1
    assert state["degraded"] and state["retry_in_s"] == 2 * DISK_RETRY_FIRST_S
    assert [s for s in (_sid(i) for i in range(3)) if s in core.cpu] == [_sid(i) for i in range(3)]
    assert sum(failures for _, failures, _ in evictor.reports) == 2


def test_the_backoff_doubles_to_its_cap_and_a_write_that_lands_clears_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    health = DiskHealth(tmp_path, clock)
    error = OSError(28, "No space left on device")
    waits = []
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        for _ in range(6):
            health.failed(error)
            waits.append(health.status()["retry_in_s"])
            assert not health.writable()
            clock.now += float(waits[-1])  # type: ignore[arg-type]
            assert health.writable()  # the retry is due
    assert waits == [5.0, 10.0, 20.0, 40.0, DISK_RETRY_MAX_S, DISK_RETRY_MAX_S]
    degraded = [r for r in caplog.records if "degraded" in r.getMessage()]
    assert len(degraded) == 1 and "ENOSPC" in degraded[0].getMessage()
    health.succeeded()
    assert health.status() == {"degraded": False} and health.writable()
    health.failed(error)  # a new degraded period starts from the first backoff
    assert health.status()["retry_in_s"] == DISK_RETRY_FIRST_S
