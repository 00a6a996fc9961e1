"""A prompt larger than the whole CPU tier: stored whole, and every chunk of it hits.

Its chunks, all asked in one lookup, hold the CPU room a promotion would need, so the
chunks that cannot be promoted are HITs read straight from disk, leased like any HIT.
The last test runs the real NodeStoreCore and disk tier (files) under the same index.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.control.test_index_properties import LocalEvictor
from tierstore.control.index import ChunkIndex, LookupState, ShardOffer, Watermarks
from tierstore.data.checksum import digest
from tierstore.keys import ChunkKey, Namespace, NodeId, ShardId, TierName
from tierstore.wire import ShardEntry

NS = Namespace("ab")
A = NodeId("node-a")
CPU, DISK = TierName.CPU, TierName.DISK
PROMPT = 10  # chunks in one chain
CHUNK = 100  # bytes each: the CPU tier holds 4 of them
CPU_BYTES = 4 * CHUNK


def key(i: int, chain: int = 0) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big") + chain.to_bytes(4, "big"))


def prompt(chain: int = 0, n: int = PROMPT) -> list[ShardOffer]:
    """One request's store: its whole chain in one batch, as vLLM offers a prefill."""
    return [
        ShardOffer(NS, key(i, chain), 0, 1, CHUNK, key(i - 1, chain) if i else None)
        for i in range(n)
    ]


def stored_index(disk_bytes: int = 100 * CHUNK) -> ChunkIndex:
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    index.register_node(A, CPU_BYTES, disk_bytes)
    result = index.admit(A, prompt(), now=0)
    assert result.accepted == [True] * PROMPT
    return index


def test_a_prompt_larger_than_the_cpu_tier_is_stored_whole_its_head_on_disk() -> None:
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    index.register_node(A, CPU_BYTES, 100 * CHUNK)
    result = index.admit(A, prompt(), now=0)
    assert result.accepted == [True] * PROMPT
    assert index.nodes()[A] == {CPU: (CPU_BYTES, CPU_BYTES, 4), DISK: (1000, 10000, 10)}
    # Demoted (never dropped) to make room: the batch's own earlier chunks.
    assert len(result.actions[A].demote) == PROMPT - 4 and not result.actions[A].drop
    assert index.stats.skipped_stores == 0


def test_without_a_disk_tier_the_overflow_is_still_skipped() -> None:
    index = ChunkIndex()
    index.register_node(A, CPU_BYTES)
    assert index.admit(A, prompt(), now=0).accepted == [True] * 4 + [False] * (PROMPT - 4)


def test_every_chunk_of_the_prompt_hits_and_stays_leased_until_released() -> None:
    index = stored_index(disk_bytes=PROMPT * CHUNK)  # the disk holds this prompt only
    keys = [key(i) for i in range(PROMPT)]
    answers, actions = index.lookup(NS, keys, "engine/r1", 0, 30)
    # No CPU room without evicting the prompt's own chunks: each is a HIT, from CPU or
    # straight from disk, and none waits on a promotion that could never happen.
    assert [a.state for a in answers] == [LookupState.HIT] * PROMPT
    assert sum(a.tier is DISK for a in answers) == PROMPT - 4
    assert all(a.where == {0: A} for a in answers)
    assert not any(na.promote or na.drop for na in actions.values())
    assert index.stats.disk_hits == PROMPT - 4
    assert all(index.is_leased(NS, k, 1) for k in keys)

    # Leased disk copies are kept: a new prompt needing disk room is refused...
    other = prompt(chain=1, n=2)
    assert index.admit(A, other, now=1).accepted == [False, False]
    assert len(index) == PROMPT
    # ...and once released, the room is taken from the (now unleased) prompt, tail first.
    index.release(NS, keys, "engine/r1")
    assert index.admit(A, other, now=2).accepted == [True, True]


def test_with_cpu_room_a_disk_chunk_is_promoted_for_the_next_hits() -> None:
    index = stored_index()
    index.register_node(A, 100 * CHUNK, 100 * CHUNK)  # the CPU tier grew: room to promote
    (answer,), actions = index.lookup(NS, [key(0)], "h", 0, 30)
    assert (answer.state, answer.tier) == (LookupState.HIT, DISK)
    assert actions[A].promote == [ShardId(NS, key(0), 0)]
    index.promoted(A, [ShardId(NS, key(0), 0)], [], [])
    (answer,), _ = index.lookup(NS, [key(0)], "h", 0, 30)
    assert answer.state is LookupState.HIT and answer.tier is CPU
    assert index.stats.disk_hits == 1


def test_the_node_store_keeps_the_whole_prompt_and_loads_it_from_disk(tmp_path: Path) -> None:
    """Real NodeStoreCore, memory and disk tiers: the batch's demoted shards are written
    straight to disk, and every HIT, from disk or memory, loads the stored bytes."""
    index = ChunkIndex(watermarks=Watermarks(1.0, 1.0))
    evictor = LocalEvictor(index)
    evictor.start_node(A, tmp_path, CPU_BYTES, 100 * CHUNK)
    core = evictor.cores[A]
    buffer = np.random.default_rng(0).integers(0, 255, PROMPT * CHUNK, dtype=np.uint8)
    entries = [
        ShardEntry(o.key, i * CHUNK, CHUNK, digest(buffer[i * CHUNK :][:CHUNK]), 1, o.parent)
        for i, o in enumerate(prompt())
    ]
    assert core.store(NS, 0, 1, entries, buffer) == PROMPT
    assert index.shards_on(A) == core.inventory()
    assert len(core.cpu) == 4 and len(core.disk) == PROMPT

    keys = [key(i) for i in range(PROMPT)]
    answers, actions = index.lookup(NS, keys, "engine/r1", 0, 30)
    assert [a.state for a in answers] == [LookupState.HIT] * PROMPT and not actions
    data, metas = core.load(NS, 0, keys)
    assert bytes(data) == bytes(buffer)
    assert [m.digest for m in metas] == [e.digest for e in entries]
