"""Types of the C extension module built from compact_index.c (see compact_index.py)."""

from typing import Any

class Core:
    """The compact index's state and decisions; CompactChunkIndex is its only caller."""

    def __init__(
        self,
        high: float,
        low: float,
        shard_id_type: type,
        answer_type: type,
        unit_id_type: type,
        hit: object,
        miss_answer: object,
        pending_answer: object,
        cpu: object,
        disk: object,
        /,
    ) -> None: ...
    def __getattr__(self, name: str) -> Any: ...
