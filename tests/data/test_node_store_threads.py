"""NodeStoreCore under the actor's threads: loads on several threads while one control
thread stores, writes through, demotes and drops the same shards, and (as in the actor)
a thread of its own writes each store through to disk (real tiers, real files; the
Evictor is an in-process fake of our own port that admits everything)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.support import Answered
from tierstore.control.index import NodeActions
from tierstore.data.checksum import digest
from tierstore.data.tiers.base import StoredShard
from tierstore.data.tiers.disk import DiskTier
from tierstore.data.tiers.memory import MemoryTier
from tierstore.errors import ChunkNotFoundError
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId
from tierstore.store.batch_queue import BatchQueue
from tierstore.store.node_store import NodeStoreCore
from tierstore.wire import ShardEntry, UnitOffer

NS = Namespace("abcd")
NODE = NodeId("n1")
KEYS = 12
SHARD = 4096
ROUNDS = 60


class AdmitAll:
    """The EvictorPort: admits every offer; one-way reports are recorded."""

    def __init__(self) -> None:
        self.forgotten: list[ShardId] = []

    def admit_units(
        self, node_id: NodeId, units: list[UnitOffer]
    ) -> Answered[tuple[list[list[bool]], NodeActions]]:
        return Answered(([[True] * len(u.shards) for u in units], NodeActions()))

    def restore(self, node_id, held, grace=False):  # type: ignore[no-untyped-def]
        return Answered(([True] * len(held), NodeActions()))

    def promoted(
        self, node_id: NodeId, done: list[ShardId], failed: list[ShardId], refused: list[ShardId]
    ) -> None:
        pass

    def forget_shards(self, node_id: NodeId, shard_ids: list[ShardId]) -> None:
        self.forgotten += shard_ids

    def report_corrupt_after_hit(self, node_id: NodeId, shard_ids: list[ShardId]) -> None:
        raise AssertionError(f"no shard is corrupt, yet {shard_ids} was reported")

    def replicated(self, node_id: NodeId, done: list[ShardId], failed: list[ShardId]) -> None:
        pass

    def report_disk_writes(
        self, node_id: NodeId, unwritten: list[ShardId], failures: int, writable: bool
    ) -> None:
        pass


class AdmitAllWriteThrough(AdmitAll):
    """Admits every offer and asks for its write-through, as for a node with a disk."""

    def admit_units(
        self, node_id: NodeId, units: list[UnitOffer]
    ) -> Answered[tuple[list[list[bool]], NodeActions]]:
        persist = [ShardId(o.namespace, o.key, o.rank) for u in units for o in u.shards]
        return Answered(([[True] * len(u.shards) for u in units], NodeActions(persist=persist)))


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\0")


def _bytes(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SHARD, dtype=np.uint8)


def _control(core: NodeStoreCore, rng: random.Random, last: dict[int, str] | None = None) -> None:
    """The control thread: stores, write-through, demotions, promotions and drops;
    ``last`` gets each key's last step."""
    for _ in range(ROUNDS):
        i = rng.randrange(KEYS)
        data = _bytes(i)
        entry = ShardEntry(_key(i), 0, SHARD, digest(data), 1)
        core.store(NS, 0, 1, [entry], data)
        sid = ShardId(NS, _key(i), 0)
        step = rng.choice(["persist", "demote", "promote", "drop"])
        core.apply(NodeActions(**{step: [sid]}))
        if last is not None:
            last[i] = step


def _loads(core: NodeStoreCore, rng: random.Random, served: list[int]) -> None:
    """A data thread: every answer is the shard's own bytes, or a clean miss."""
    for _ in range(ROUNDS * 4):
        keys = rng.sample(range(KEYS), 3)
        try:
            data, metas = core.load(NS, 0, [_key(i) for i in keys])
        except ChunkNotFoundError:
            continue
        assert bytes(data) == b"".join(bytes(_bytes(i)) for i in keys)
        assert [m.digest for m in metas] == [digest(_bytes(i)) for i in keys]
        served.append(len(keys))


def _inventory(core: NodeStoreCore) -> None:
    for _ in range(ROUNDS * 2):
        core.inventory()
        core.status()


def _run(targets: list[Callable[[], None]]) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # reported by the test, not lost with the thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_loads_beside_stores_demotions_and_drops_get_right_bytes_or_a_miss(
    tmp_path: Path,
) -> None:
    disk = DiskTier(tmp_path / "disk", KEYS * SHARD)
    core = NodeStoreCore(NODE, MemoryTier(KEYS * SHARD), disk, AdmitAll())
    served: list[int] = []
    for seed in range(5):  # a few interleavings; each run is deterministic per thread
        errors = _run(
            [lambda s=seed: _control(core, random.Random(s))]
            + [
                lambda s=seed, t=t: _loads(core, random.Random(s * 10 + t), served)
                for t in range(3)
            ]
            + [lambda: _inventory(core)]
        )
        assert not errors, errors
    assert served, "no load found a shard: the test proved nothing"
    stats = core.status()["stats"]
    assert stats["corrupt_before_hit"] == stats["corrupt_after_hit"] == 0
    assert disk.corrupt_chunks_removed == 0
    # The byte counts agree with what the tiers hold, and every disk chunk verifies.
    assert core.cpu.used_bytes == sum(m.nbytes for _, m in core.cpu.items())
    assert disk.used_bytes == sum(m.nbytes for _, m in disk.items())
    assert all(disk.get(s).meta == m for s, m in disk.items())


def _core_writing_through(disk: DiskTier) -> tuple[NodeStoreCore, BatchQueue[list[ShardId]]]:
    """A core whose stores' write-through goes to a queue's own thread, as in the actor."""
    queue: BatchQueue[list[ShardId]] = BatchQueue(
        lambda batches: core.write_through([s for batch in batches for s in batch]),
        "test-write-through",
    )
    core = NodeStoreCore(
        NODE, MemoryTier(KEYS * SHARD), disk, AdmitAllWriteThrough(), defer=queue.put
    )
    return core, queue


def test_write_through_on_its_own_thread_leaves_no_dropped_shard_on_disk(tmp_path: Path) -> None:
    """Each store's write-through is queued to another thread (as the actor does) while
    the control thread demotes, promotes and drops the same shards: once it is drained,
    a shard whose last step was a drop is nowhere (a write-through that waited behind
    the drop wrote nothing), and every other one is on disk and verifies."""
    disk = DiskTier(tmp_path / "disk", KEYS * SHARD)
    core, queue = _core_writing_through(disk)
    last: dict[int, str] = {}
    served: list[int] = []
    for seed in range(5):
        errors = _run(
            [
                lambda s=seed: _control(core, random.Random(s), last),
                lambda s=seed: _loads(core, random.Random(s * 10 + 7), served),
            ]
        )
        assert not errors, errors
    assert queue.wait_idle(30.0)
    queue.close(1.0)
    assert served, "no load found a shard: the test proved nothing"
    assert "drop" in last.values() and set(last.values()) != {"drop"}
    for i, step in last.items():
        sid = ShardId(NS, _key(i), 0)
        if step == "drop":
            assert sid not in disk and sid not in core.cpu, (i, "written after its drop")
        else:
            assert disk.get(sid).meta.digest == digest(_bytes(i)), (i, step)
    assert disk.used_bytes == sum(m.nbytes for _, m in disk.items())
    assert core.status()["stats"]["corrupt_before_hit"] == 0


class GatedDisk(DiskTier):
    """A real disk tier whose writes wait at a gate once started, so a test can drop a
    shard while its write-through is under way."""

    def __init__(self, root: Path, capacity: int) -> None:
        super().__init__(root, capacity)
        self.writing = threading.Event()
        self.gate = threading.Event()

    def put(self, shard_id: ShardId, shard: StoredShard) -> None:
        self.writing.set()
        assert self.gate.wait(10.0)
        super().put(shard_id, shard)


def test_a_drop_during_a_write_through_leaves_nothing_on_disk(tmp_path: Path) -> None:
    """The Evictor drops a shard while the write-through thread is writing it: the drop
    waits for that one write and then removes it, so no file outlives the drop (the
    Evictor would never drop it again)."""
    disk = GatedDisk(tmp_path / "disk", KEYS * SHARD)
    core, queue = _core_writing_through(disk)
    data = _bytes(1)
    core.store(NS, 0, 1, [ShardEntry(_key(1), 0, SHARD, digest(data), 1)], data)
    sid = ShardId(NS, _key(1), 0)
    assert disk.writing.wait(10.0), "the store queued no write-through"
    dropping = threading.Thread(target=core.drop, args=([sid],))
    dropping.start()
    dropping.join(0.3)  # the drop has run by now, or waits for the write
    disk.gate.set()
    dropping.join(10.0)
    assert queue.wait_idle(10.0)
    queue.close(1.0)
    assert sid not in disk and sid not in core.cpu
    assert disk.used_bytes == 0
