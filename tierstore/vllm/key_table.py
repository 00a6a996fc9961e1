"""A compact set of keys, each with a 16-bit mask: one 64-bit word per slot, no object per key.

:class:`KeyTable` is an open-addressing hash table (linear probing) over a numpy
``uint64`` array. Each slot packs a key's fingerprint (its XXH3-64 hash, cut to
``fingerprint_bits``, never 0) above a 16-bit mask (what the owner records per key: for
the cluster view, which copies exist). A slot of 0 is empty; a slot of 1 (fingerprint 0,
never a key's) is a tombstone left by a removal, skipped by probes and cleared when the
table is rebuilt. The table is rebuilt (resized to :data:`_REBUILD_LOAD`) when live keys
and tombstones fill :data:`_MAX_LOAD` of it, or removals leave live keys in less than
:data:`_MIN_LOAD` of it, so it costs 8 / 0.75 to 8 / 0.5 bytes per key: 10.7 to 16 B
(above :data:`_MIN_SLOTS` slots).

Keys are known by fingerprint only: two keys whose fingerprints agree are one entry to
the table. That is a false positive of :meth:`KeyTable.mask` (a key never added reads
as present, with another key's mask) with probability about ``len / 2**fingerprint_bits``
per key asked (at 10^7 keys and 48 bits, 4e-8). The owner must treat a present key as a
claim to verify, never as the key's bytes: the cluster view's hits are leased by the
Evictor and loaded by full key, so a false positive costs a lookup or a recompute.

Batch calls (:meth:`update`) run vectorised; single-key calls (:meth:`mask`) probe from
Python. Not thread-safe: the owner holds its lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

_EMPTY = 0
_TOMBSTONE = 1  # fingerprint 0, mask 1: no key's fingerprint is 0
_MASK_BITS = 16
_MASK_ALL = (1 << _MASK_BITS) - 1
_MIN_SLOTS = 64
# Rebuilt when live keys plus tombstones fill this share of the slots ...
_MAX_LOAD = 0.75
# ... to a table this full of live keys (8 / 0.55 B per key, right after) ...
_REBUILD_LOAD = 0.55
# ... and when removals leave fewer live keys than this share: never over 8 / 0.5 = 16 B.
_MIN_LOAD = 0.5


class KeyTable:
    """Keys (bytes) -> a 16-bit mask, in 8 bytes per slot; see the module docstring."""

    def __init__(self, fingerprint_bits: int = 48) -> None:
        """``fingerprint_bits``: how much of each key's hash is kept (1-48); fewer bits,
        more false positives (no less memory: a slot is one word)."""
        if not 1 <= fingerprint_bits <= 64 - _MASK_BITS:
            raise ValueError(
                f"fingerprint_bits: expected 1 to {64 - _MASK_BITS}, got {fingerprint_bits!r}"
            )
        self._fp_mod = (1 << fingerprint_bits) - 1  # fingerprints are 1 .. 2**bits - 1
        self._slots = np.zeros(_MIN_SLOTS, dtype=np.uint64)
        self._words = memoryview(self._slots).cast("B").cast("Q")  # fast scalar reads
        self._live = 0
        self._tombstones = 0

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        """Bytes the table holds (its slots)."""
        return int(self._slots.nbytes)

    def fingerprint(self, key: bytes) -> int:
        return xxhash.xxh3_64_intdigest(key) % self._fp_mod + 1

    def fingerprints(self, keys: Sequence[bytes]) -> np.ndarray:
        digests = np.fromiter(map(xxhash.xxh3_64_intdigest, keys), dtype=np.uint64, count=len(keys))
        return digests % np.uint64(self._fp_mod) + np.uint64(1)

    # ---- one key ---------------------------------------------------------------------------
    def mask(self, key: bytes) -> int:
        """The mask of ``key`` (of any key with its fingerprint); 0 if absent."""
        fp = self.fingerprint(key)
        words = self._words
        n = len(words)
        i = fp % n
        while True:
            word = words[i]
            if word == _EMPTY:
                return 0
            if word >> _MASK_BITS == fp:
                return word & _MASK_ALL
            i = i + 1 if i + 1 < n else 0

    def __contains__(self, key: bytes) -> bool:
        return self.mask(key) != 0

    # ---- batches ---------------------------------------------------------------------------
    def update(self, keys: Sequence[bytes], set_bits: int = 0, clear_bits: int = 0) -> None:
        """For each key: ``mask = (mask & ~clear_bits) | set_bits``. A key whose mask
        becomes 0 is removed; one absent is added only if ``set_bits`` is not 0."""
        if not keys:
            return
        fps = np.sort(self.fingerprints(keys))
        fps = fps[np.concatenate(([True], fps[1:] != fps[:-1]))]  # distinct
        slots = self._find(fps)
        found = slots >= 0
        if found.any():
            at = slots[found]
            masks = (self._slots[at] & np.uint64(_MASK_ALL)) & np.uint64(~clear_bits & _MASK_ALL)
            masks |= np.uint64(set_bits)
            gone = masks == 0
            self._slots[at] = np.where(
                gone, np.uint64(_TOMBSTONE), (fps[found] << np.uint64(_MASK_BITS)) | masks
            )
            n_gone = int(gone.sum())
            self._live -= n_gone
            self._tombstones += n_gone
            if n_gone and self._live < _MIN_LOAD * len(self._slots) > _MIN_SLOTS:
                self._rebuild(self._live)
        if set_bits & _MASK_ALL:
            self._insert(fps[~found], set_bits & _MASK_ALL)

    def _find(self, fps: np.ndarray) -> np.ndarray:
        """Slot of each fingerprint, -1 where absent."""
        n = len(self._slots)
        shift = np.uint64(_MASK_BITS)
        out = np.full(len(fps), -1, dtype=np.int64)
        pos = (fps % np.uint64(n)).astype(np.int64)
        active = np.arange(len(fps))
        while active.size:
            words = self._slots[pos[active]]
            hit = (words >> shift) == fps[active]
            out[active[hit]] = pos[active[hit]]
            active = active[~hit & (words != _EMPTY)]
            pos[active] = (pos[active] + 1) % n
        return out

    def _insert(self, fps: np.ndarray, bits: int) -> None:
        """Add absent fingerprints (distinct), each with mask ``bits``."""
        if not len(fps):
            return
        if (self._live + self._tombstones + len(fps)) > _MAX_LOAD * len(self._slots):
            self._rebuild(self._live + len(fps))
        self._place(fps, (fps << np.uint64(_MASK_BITS)) | np.uint64(bits))
        self._live += len(fps)

    def _place(self, fps: np.ndarray, words: np.ndarray) -> None:
        """Write each word into the first empty slot of its fingerprint's probe. Words
        after one slot are all written there; the one that stays took it, the others
        probe on (a scatter, no sort: a round costs O(words left))."""
        slots = self._slots
        n = len(slots)
        pos = (fps % np.uint64(n)).astype(np.int64)
        pending = np.arange(len(fps))
        while pending.size:
            at = pos[pending]
            free = slots[at] == _EMPTY
            trying, tried_at = pending[free], at[free]
            slots[tried_at] = words[trying]
            placed = np.zeros(len(pending), dtype=bool)
            placed[np.flatnonzero(free)[slots[tried_at] == words[trying]]] = True
            pending = pending[~placed]
            pos[pending] = (pos[pending] + 1) % n

    def _rebuild(self, live: int) -> None:
        """Resize to hold ``live`` keys at :data:`_REBUILD_LOAD`, dropping tombstones."""
        old = self._slots
        kept = old[old > _TOMBSTONE]
        size = max(_MIN_SLOTS, int(live / _REBUILD_LOAD) + 1)
        self._slots = np.zeros(size, dtype=np.uint64)
        self._words = memoryview(self._slots).cast("B").cast("Q")
        self._tombstones = 0
        self._place(kept >> np.uint64(_MASK_BITS), kept)
