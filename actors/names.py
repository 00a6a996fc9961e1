"""The Ray names of tierstore's actors (a module of its own: every actor module needs them)."""

from __future__ import annotations

EVICTOR_NAME = "tierstore-evictor"


def node_store_name(node_id: str) -> str:
    return f"tierstore-nodestore-{node_id}"
