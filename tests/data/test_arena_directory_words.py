"""Words of the arena's directory that name no extent are a miss, never a read.

Any process that maps a node's arena can write its directory, so a worker trusts an
entry's words only once they name an extent of this arena: the offset aligned and
inside the extents (not in the tables after them, not past the mapping), the length
inside from there, the slot word one the NodeStore writes. Anything else is a miss
(counted): the load pins through the NodeStore, as for any other miss. Real arena file,
real tier writing the entry, a worker's own mapping reading it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tierstore.data.arena.directory import arena_tables
from tierstore.data.arena.region import ArenaMapping
from tierstore.data.checksum import digest
from tierstore.data.tiers.arena import ArenaTier
from tierstore.data.tiers.base import ShardMeta
from tierstore.keys import ChunkKey, Namespace, ShardId

NS = Namespace("d0d0e1e1")
SHARD = ShardId(NS, ChunkKey(b"w" * 8 + b"\0\0\0\0"), 0)
NBYTES = 1024
_OFFSET, _NBYTES, _DIGEST, _SLOTS, _GENERATION = 3, 4, 5, 6, 7  # words of an entry
_ALL_SLOTS = 1 << 63


class Worker:
    """A worker's own mapping of the arena, and the entry of SHARD in it (its words)."""

    def __init__(self, tier: ArenaTier) -> None:
        self.mapping = ArenaMapping(tier.info)
        self.generations, self.directory = arena_tables(self.mapping.array)
        start = self.directory.extents_bytes
        words = self.mapping.array[start : start + self.directory.nbytes].view(np.uint64)
        rows = words.reshape(-1, 8)
        (self.row,) = [r for r in rows if r[0] != 0]  # the one entry written
        self.saved = self.row.copy()

    def write(self, word: int, value: int) -> None:
        """What any process mapping the arena can do: its seq word stays even."""
        self.row[word] = np.uint64(value)

    def restore(self) -> None:
        self.row[:] = self.saved


@pytest.fixture
def worker(arena_tier: ArenaTier) -> Iterator[Worker]:
    data = np.full(NBYTES, 7, np.uint8)
    arena_tier.fill(SHARD, ShardMeta(NBYTES, digest(data), 0b11), lambda out: out.fill(7))
    w = Worker(arena_tier)
    yield w
    w.mapping.close()


CORRUPT: dict[str, tuple[int, Callable[[Worker], int]]] = {
    "offset past the mapping": (_OFFSET, lambda w: 1 << 40),
    "offset at the last aligned word": (_OFFSET, lambda w: (1 << 64) - 64),
    "offset in the directory itself": (_OFFSET, lambda w: w.directory.extents_bytes),
    "offset in the generations table": (_OFFSET, lambda w: w.generations.extents_bytes + 64),
    "offset inside its extent, unaligned": (_OFFSET, lambda w: int(w.saved[_OFFSET]) + 8),
    "length into the tables": (
        _NBYTES,
        lambda w: w.directory.extents_bytes - int(w.saved[_OFFSET]) + 64,
    ),
    "length past the mapping": (_NBYTES, lambda w: (1 << 64) - 1),
    "no length": (_NBYTES, lambda w: 0),
    "all slots of a million-block chunk": (_SLOTS, lambda w: _ALL_SLOTS | (1 << 20)),
    "all slots of a three-block chunk": (_SLOTS, lambda w: _ALL_SLOTS | 3),
}


@pytest.mark.parametrize("what", sorted(CORRUPT))
def test_a_corrupt_directory_word_is_a_miss(worker: Worker, what: str) -> None:
    (found,) = worker.directory.find([SHARD]) or [None]
    assert found is not None and found.meta.nbytes == NBYTES
    word, value = CORRUPT[what]
    worker.write(word, value(worker))
    assert worker.directory.find([SHARD]) is None  # a miss: the load pins
    assert worker.directory.malformed == 1
    worker.restore()
    assert worker.directory.find([SHARD]) == [found]


def test_a_job_with_one_corrupt_entry_is_a_miss_whole(arena_tier: ArenaTier) -> None:
    other = ShardId(NS, ChunkKey(b"v" * 8 + b"\0\0\0\0"), 0)
    for shard_id in (SHARD, other):
        arena_tier.fill(shard_id, ShardMeta(NBYTES, 1, 1), lambda out: out.fill(0))
    mapping = ArenaMapping(arena_tier.info)
    _, directory = arena_tables(mapping.array)
    assert directory.find([SHARD, other]) is not None
    start = directory.extents_bytes
    rows = mapping.array[start : start + directory.nbytes].view(np.uint64).reshape(-1, 8)
    [first, _] = [row for row in rows if row[0]]  # the two entries written
    first[_OFFSET] = np.uint64(1 << 40)
    assert directory.find([SHARD, other]) is None
    mapping.close()


def test_the_node_store_writes_no_entry_its_readers_would_refuse(arena_tier: ArenaTier) -> None:
    """A shard whose metadata cannot be an entry (a digest past 64 bits, from a replica
    or a promotion) is held, and simply not in the directory: its loads pin. Before,
    writing the entry raised after the shard was already in the tier's map."""
    bad = ShardId(NS, ChunkKey(b"x" * 8 + b"\0\0\0\0"), 0)
    arena_tier.fill(bad, ShardMeta(NBYTES, 1 << 64, 1), lambda out: out.fill(0))
    assert bad in arena_tier and arena_tier.used_bytes == NBYTES
    _, directory = arena_tables(ArenaMapping(arena_tier.info).array)
    assert directory.find([bad]) is None
