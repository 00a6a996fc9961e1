"""tierstore's exception hierarchy: every failure a caller may handle has its own type."""

from __future__ import annotations


class TierStoreError(Exception):
    """Base class of every error tierstore raises on purpose."""


class ConfigError(TierStoreError, ValueError):
    """A configuration key is unknown, missing or has a bad value."""


class TierFullError(TierStoreError):
    """A tier has no room for a chunk and nothing may be evicted to make room."""


class ChunkNotFoundError(TierStoreError, KeyError):
    """A chunk that was asked for is not held where it was expected."""


class ChunkCorruptError(TierStoreError):
    """A chunk's bytes do not match its length or checksum: it must never be served."""


class ClusterUnavailableError(TierStoreError, ConnectionError):
    """Ray or one of tierstore's actors cannot be reached."""


class UnknownNodeError(TierStoreError, KeyError):
    """The Evictor has no record of a node (it restarted and has not heard from it yet)."""


class ActorUnavailableError(ClusterUnavailableError):
    """A tierstore actor died or cannot be reached right now (it may be restarting)."""


class RemoteCallTimeout(TierStoreError, TimeoutError):
    """A call to a tierstore actor got no answer before its deadline."""


class RemoteCallError(TierStoreError):
    """A call to a tierstore actor raised something that is not a TierStoreError."""
