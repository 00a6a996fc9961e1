"""The scheduler's local key set: bytes per chunk and lookup speed of its presence snapshot.

``python -m tierstore.deploy.bench.keyset [--chunks N ...]``: builds the cluster view's
:class:`~tierstore.vllm.cluster_view.Presence` from one snapshot of N chunks (12-byte
keys, every chunk in one node's memory, a third also on another node's disk),
and, for comparison, what it replaced: a dict from key to a copies bitmask. Reported per
N: bytes per chunk (the table's own, and the process's traced allocations; the dict's
with and without the key objects it keeps alive), the
snapshot's build time, and single-key lookups per second for held and absent keys.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from tierstore.keys import ChunkKey, Namespace, NodeId, TierName
from tierstore.vllm.cluster_view import Presence
from tierstore.wire import ResidencyEvent

NS = Namespace("keyset-bench")
HERE, OTHER = NodeId("node-here"), NodeId("node-other")
_LOOKUPS = 200_000


def _keys(n: int, salt: bytes) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(8) + salt) for _ in range(n)]


def _traced(build: Callable[[], Any]) -> tuple[Any, int, float]:
    """``build()``, the bytes it left allocated, and its seconds."""
    gc.collect()
    tracemalloc.start()
    started = time.perf_counter()
    built = build()
    seconds = time.perf_counter() - started
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return built, size, seconds


def _rate(check: Callable[[ChunkKey], object], keys: list[ChunkKey]) -> float:
    started = time.perf_counter()
    for key in keys:
        check(key)
    return len(keys) / (time.perf_counter() - started)


def measure(n: int) -> dict[str, Any]:
    keys = _keys(n, b"\0\0\0\0")
    absent = _keys(min(n, _LOOKUPS), b"\0\0\0\1")
    events = [
        ResidencyEvent(0, NS, HERE, TierName.CPU, False, keys),
        ResidencyEvent(1, NS, OTHER, TierName.DISK, False, keys[::3]),
    ]

    def compact() -> Presence:
        presence = Presence(HERE)
        presence.apply(events)
        return presence

    def as_dict() -> dict[ChunkKey, int]:
        copies: dict[ChunkKey, int] = {}
        for bit, event in enumerate(events):
            for key in event.keys:
                copies[key] = copies.get(key, 0) | 1 << bit
        return copies

    presence, traced, build_s = _traced(compact)
    copies, dict_traced, dict_build_s = _traced(as_dict)
    held = keys[:_LOOKUPS]
    return {
        "chunks": n,
        "compact": {
            "table_bytes_per_chunk": presence.nbytes / n,
            "traced_bytes_per_chunk": traced / n,
            "build_s": build_s,
            "held_lookups_per_s": _rate(lambda k: presence.where(k, HERE), held),
            "absent_lookups_per_s": _rate(lambda k: presence.where(k, HERE), absent),
        },
        "dict": {
            "traced_bytes_per_chunk": dict_traced / n,
            # The dict keeps its keys alive; the compact table keeps none.
            "with_keys_bytes_per_chunk": dict_traced / n + sys.getsizeof(keys[0]),
            "build_s": dict_build_s,
            "held_lookups_per_s": _rate(copies.get, held),
        },
        "false_positives": sum(1 for k in absent if k in presence),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[100_000, 1_000_000])
    args = parser.parse_args()
    print(json.dumps([measure(n) for n in args.chunks], indent=1))


if __name__ == "__main__":
    main()
