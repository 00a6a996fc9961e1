"""Where a chunk lives, in vLLM's words: medium (CPU or STORAGE) and locality (LOCAL or
REMOTE to this engine's node). Used for per-request ``kv_load_tiers`` and KV events."""

from __future__ import annotations

from collections.abc import Iterable

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from tierstore.keys import NodeId, TierName
from tierstore.wire import ResidencyEvent

MEDIUMS = {TierName.CPU: Medium.CPU, TierName.DISK: Medium.STORAGE}


def locality(nodes: Iterable[NodeId], local_node: NodeId | None) -> Locality:
    """LOCAL when every copy named is on ``local_node``."""
    local = all(node == local_node for node in nodes)
    return Locality.LOCAL if local else Locality.REMOTE


def offloading_events(
    events: Iterable[ResidencyEvent], local_node: NodeId | None
) -> list[OffloadingEvent]:
    """The Evictor's residency changes as vLLM's KV-cache events."""
    return [
        OffloadingEvent(
            keys=[OffloadKey(key) for key in event.keys],
            medium=MEDIUMS[TierName(event.tier)],
            removed=event.removed,
            locality=locality((event.node,), local_node),
        )
        for event in events
    ]


class EventQueue:
    """KV-cache events waiting for vLLM's ``take_events`` (only where vLLM drains them:
    KV-cache events on). Callers hold the manager's lock."""

    def __init__(self, local_node: NodeId | None) -> None:
        self._local_node = local_node
        self._events: list[OffloadingEvent] = []

    def extend(self, events: Iterable[ResidencyEvent]) -> None:
        self._events.extend(offloading_events(events, self._local_node))

    def take(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events
