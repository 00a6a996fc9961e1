"""Where each shard of a node's arena lives, kept in the arena itself: lets any worker of
the node load a shard without asking its NodeStore first (no pin, no round trip).

The NodeStore writes an entry as it comes to hold a shard in an extent (a worker's
commit adopted, a disk promotion, a copy from another node; a pin writes it again), under
its tier's lock: ``(shard hash, offset, bytes, digest, slots, generation)``. A worker
looking for a shard reads the entry; it is only a hint, used as a seqlock read of the
extent (:mod:`tierstore.data.arena.generations`): the extent's generation must be the
entry's before the hash and after the copy, and the bytes must match the digest. Any
other outcome and the load pins, as before.

Four-way set-associative by a 128-bit hash of ``(namespace, key, rank)``: a shard's entry
sits in one of the four of its bucket. A writer takes the shard's own entry, else an
empty one, else a stale one (its extent's generation moved on: freed since), else one
picked by the hash; a shard whose entry another took is not found (it pins; the pin
writes its entry back). Entries are never deleted: a stale one fails the reader's
check. One entry per 4 KiB of region, up to 4M (256 MiB): every chunk has room even at
16 KiB. Direct-mapped and capped at 64K entries, as it was, a 32-chunk load of 32 KiB
chunks missed one entry about once in three on an 8 MiB arena, and almost always on a
large arena of small chunks, and each such miss cost a pin round trip (7-9 ms on a busy
engine) instead of none.

Each entry is one cache line of uint64 words, ``[seq, hash_hi, hash_lo, offset, nbytes,
digest, slot_mask, generation]`` (a chunk of more than 63 slots: only when all are
filled, as a flag and their number). The writer makes ``seq`` odd, writes the fields, makes
it even; a reader reads ``seq``, the fields, ``seq`` again and trusts the fields only if
both reads are the same even value (x86-64 keeps stores, and loads, in program order;
elsewhere :data:`~tierstore.data.arena.generations.UNPINNED_READS` is False and nothing
reads it).

Any process that maps the arena can write its words, so a reader trusts none of them
until they name an extent of this arena (``_decode``): offset aligned and inside the
extents, length inside from there, a slot word :func:`_encode_slots` could write. Any
other entry is a miss (counted in ``malformed``), and the load pins: never a read
outside an extent.

Pure numpy: the NodeStore and the workers each wrap their own mapping of the region.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import xxhash

from tierstore.data.arena.allocator import DEFAULT_ALIGN
from tierstore.data.arena.generations import Generations
from tierstore.fields import MAX_SLOTS
from tierstore.keys import ShardId
from tierstore.wire import ShardMeta

MAX_DIRECTORY_BYTES = 1 << 28  # 4M entries: 256 MiB of an arena of 64 GiB or more
_WORDS = 8  # uint64 words per entry: one cache line
_WAYS = 4  # entries per bucket
EMPTY_BYTES = _WAYS * _WORDS * 8  # the smallest directory: one bucket (finds nothing when zeroed)
_SEQ, _HASH_HI, _HASH_LO, _OFFSET, _NBYTES, _DIGEST, _SLOTS, _GENERATION = range(_WORDS)
_LOW_64 = (1 << 64) - 1
# A slot mask wider than 63 bits (chunks of more than 63 blocks) is kept only when every
# slot is filled, as this flag plus the number of slots.
_ALL_SLOTS = 1 << 63


def directory_bytes(region_bytes: int) -> int:
    """Bytes of a region of ``region_bytes`` that hold the directory: a power of two
    entries, at least one bucket, at most :data:`MAX_DIRECTORY_BYTES` and 1/64 of the
    region."""
    entries = max(min(MAX_DIRECTORY_BYTES, region_bytes // 64) // (_WORDS * 8), _WAYS)
    return (1 << (entries.bit_length() - 1)) * _WORDS * 8


class Located(NamedTuple):
    """Where a shard was held: its extent, its metadata then, the extent's generation."""

    offset: int
    meta: ShardMeta
    generation: int


def _encode_slots(slot_mask: int) -> int | None:
    if 0 <= slot_mask < _ALL_SLOTS:
        return slot_mask
    width = slot_mask.bit_length()
    full = slot_mask == (1 << width) - 1 and width <= MAX_SLOTS
    return _ALL_SLOTS | width if full else None


def _decode_slots(word: int) -> int | None:
    """The slot mask of a word, None if it is not one :func:`_encode_slots` writes."""
    if not word & _ALL_SLOTS:
        return word
    width = word & ~_ALL_SLOTS
    return (1 << width) - 1 if _ALL_SLOTS.bit_length() <= width <= MAX_SLOTS else None


def _hash(shard_id: ShardId) -> tuple[int, int]:
    namespace, key, rank = shard_id
    h = xxhash.xxh3_128_intdigest(b"%s\0%d\0%s" % (namespace.encode(), rank, bytes(key)))
    return h >> 64, h & _LOW_64


class ShardDirectory:
    """The directory at the end of ``region`` (a uint8 array: the part of the mapping
    before the generations table). ``generations``: the arena's table, which tells the
    writer a stale entry (its extent freed since) from a live one."""

    def __init__(
        self,
        region: np.ndarray,
        generations: Generations | None = None,
        align: int = DEFAULT_ALIGN,
    ) -> None:
        self.nbytes = directory_bytes(len(region))
        self.extents_bytes = len(region) - self.nbytes  # the region before the directory
        start = self.extents_bytes
        self._entries = region[start : start + self.nbytes].view(np.uint64).reshape(-1, _WORDS)
        self._mask = len(self._entries) // _WAYS - 1  # buckets - 1
        self._words = memoryview(self._entries.reshape(-1))  # uint64 words, read as ints
        self._generations = generations
        self._align = align  # the allocator's: every extent starts at a multiple of it
        self.malformed = 0  # entries found whose words named no extent (a miss each)

    def record(self, shard_id: ShardId, offset: int, meta: ShardMeta, generation: int) -> None:
        """NodeStore, under its tier's lock (one writer at a time): ``shard_id`` is held
        at ``offset``, whose generation is ``generation`` while it holds it."""
        slots = _encode_slots(meta.slot_mask)
        if slots is None or not self._fits(offset, meta.nbytes, meta.digest, generation):
            return  # a partial chunk of more than 63 slots (or not a shard): its loads pin
        hi, lo = _hash(shard_id)
        entry = self._entries[self._way_for(hi, lo)]
        entry[_SEQ] += np.uint64(1)  # odd: being written
        fields = (hi, lo, offset, meta.nbytes, meta.digest, slots, generation)
        entry[_HASH_HI:] = np.array(fields, dtype=np.uint64)
        entry[_SEQ] += np.uint64(1)  # even: whole again

    def _fits(self, offset: int, nbytes: int, digest: int, generation: int) -> bool:
        """Whether an entry's fields name an extent of this arena and fit their words:
        what the NodeStore writes, and what a reader trusts (any other word pointed
        outside the extents, or was never written by a NodeStore)."""
        return (
            0 <= offset < self.extents_bytes
            and offset % self._align == 0
            and 0 < nbytes <= self.extents_bytes - offset
            and 0 <= digest <= _LOW_64
            and 0 <= generation <= _LOW_64
        )

    def _way_for(self, hi: int, lo: int) -> int:
        """The entry a shard of hash ``(hi, lo)`` takes in its bucket: its own, an empty
        one, a stale one, else one picked by the hash."""
        first = (lo & self._mask) * _WAYS
        words = self._words[first * _WORDS : (first + _WAYS) * _WORDS].tolist()
        rows = [words[i : i + _WORDS] for i in range(0, _WAYS * _WORDS, _WORDS)]
        for way, row in enumerate(rows):
            if row[_HASH_HI] == hi and row[_HASH_LO] == lo:
                return first + way
        for way, row in enumerate(rows):
            if row[_SEQ] == 0:
                return first + way
        if self._generations is not None:
            current = self._generations.read([row[_OFFSET] for row in rows])
            for way, (row, now) in enumerate(zip(rows, current, strict=True)):
                if row[_GENERATION] != now:
                    return first + way
        return first + hi % _WAYS

    def bucket_of(self, shard_id: ShardId) -> int:
        """The bucket whose four entries ``shard_id``'s may take (tests, diagnostics)."""
        return _hash(shard_id)[1] & self._mask

    def find(self, shard_ids: Sequence[ShardId]) -> list[Located] | None:
        """Any process mapping the arena: where each shard was last recorded, or None if
        one of them has no whole entry of its own.

        Word by word through a memoryview: a job's few entries cost a few us each this
        way, against ~50 us of small numpy operations for one entry on this machine."""
        found = []
        for shard_id in shard_ids:
            located = self._find_one(*_hash(shard_id))
            if located is None:
                return None
            found.append(located)
        return found

    def _find_one(self, hi: int, lo: int) -> Located | None:
        words = self._words
        bucket = (lo & self._mask) * _WAYS * _WORDS
        for at in range(bucket, bucket + _WAYS * _WORDS, _WORDS):
            if words[at + _HASH_LO] != lo:  # one word per way that is not this shard's
                continue
            seq = words[at]  # seq first, then the fields, then seq again
            row = words[at : at + _WORDS].tolist()
            if seq & 1 or words[at] != seq or row[_HASH_HI] != hi:
                return None  # being written, or another shard's: not trusted
            return self._decode(row)
        return None

    def _decode(self, row: list[int]) -> Located | None:
        """The one place a worker turns an entry's words into an extent to read: words
        that name no extent of this arena (any process mapping it can write them) are a
        miss, counted in :attr:`malformed`; the load pins through the NodeStore."""
        offset, nbytes, digest = row[_OFFSET], row[_NBYTES], row[_DIGEST]
        slots = _decode_slots(row[_SLOTS])
        if slots is None or not self._fits(offset, nbytes, digest, row[_GENERATION]):
            self.malformed += 1
            return None
        return Located(offset, ShardMeta(nbytes, digest, slots), row[_GENERATION])


def arena_tables(
    array: np.ndarray, align: int = DEFAULT_ALIGN
) -> tuple[Generations, ShardDirectory]:
    """The tables at the end of an arena mapping (``array``: all of it), generations last
    and the directory before them: the one layout the NodeStore and its workers share.
    The extents are ``array[: directory.extents_bytes]``, each at a multiple of
    ``align`` (the allocator's)."""
    generations = Generations(array)
    directory = ShardDirectory(array[: generations.extents_bytes], generations, align)
    return generations, directory
