"""The Ray names of tierstore's actors (a module of its own: every actor module needs them)."""

from __future__ import annotations

EVICTOR_NAME = "tierstore-evictor"  # shard 0's


def evictor_name(shard: int) -> str:
    """The Ray name of Evictor shard ``shard`` (shard 0 keeps the unsharded name)."""
    return EVICTOR_NAME if shard == 0 else f"{EVICTOR_NAME}-{shard}"


def node_store_name(node_id: str) -> str:
    return f"tierstore-nodestore-{node_id}"
