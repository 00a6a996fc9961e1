"""The keys this engine stored, and when: so it does not offer them again, and does not
trust a MISS for one whose commit may not be indexed yet.

Plain bookkeeping under the manager's lock (scheduler thread, or the Evictor channel's
thread when an answer lands).
"""

from __future__ import annotations

from collections import OrderedDict

from tierstore.keys import ChunkKey

# Bounded because an engine may run for weeks. Forgetting a key only costs a duplicate
# store, which the Evictor refuses.
KNOWN_STORED_MAX = 1_000_000
# A worker reports a store done once its bytes are in the arena and commits it after
# (``tierstore.vllm.worker``): a MISS for a key stored less than this ago is asked
# again (the commit takes a few ms here), within the lookup deadline.
COMMIT_GRACE_S = 1.0


class StoredKeys:
    def __init__(self, max_keys: int = KNOWN_STORED_MAX) -> None:
        self._stored_at: OrderedDict[ChunkKey, float] = OrderedDict()
        self._max_keys = max_keys

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._stored_at

    def add(self, keys: list[ChunkKey], now: float) -> None:
        for key in keys:
            self._stored_at[key] = now
            self._stored_at.move_to_end(key)
        while len(self._stored_at) > self._max_keys:
            self._stored_at.popitem(last=False)

    def forget(self, key: ChunkKey) -> None:
        """Evicted, or its load failed: a later store may offer it again."""
        self._stored_at.pop(key, None)

    def committing(self, key: ChunkKey, now: float) -> bool:
        """Stored so recently that its commit may still be on its way to the Evictor."""
        stored_at = self._stored_at.get(key)
        return stored_at is not None and now - stored_at < COMMIT_GRACE_S

    def clear(self) -> None:
        self._stored_at.clear()
