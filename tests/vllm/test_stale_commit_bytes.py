"""A store gathered into an arena that the NodeStore has since replaced (it restarted) is
sent through the object store from its extents: the bytes must still be the gathered
ones after the worker dropped and closed its mapping of the old arena."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tierstore.data.arena.region import ArenaMapping, ArenaRegion
from tierstore.data.layout import ChunkLayout
from tierstore.vllm.arena_jobs import ArenaJobs, Filled

PAGE = 4096


def test_a_stale_commit_reads_its_extents_after_the_mapping_is_closed(tmp_path: Path) -> None:
    layout = ChunkLayout([torch.zeros(4, PAGE, dtype=torch.int8)], [[(0, PAGE)]], 2)
    plan = layout.plan([4], [0])  # four blocks: two chunks of two pages
    region = ArenaRegion.create("ns-stale", "n1", 1 << 20, shm_dir=tmp_path)
    mapping = ArenaMapping(region.info)
    offsets = [3 * PAGE, 0]
    expected = []
    for at, chunk in zip(offsets, plan.chunks, strict=True):
        data = np.random.default_rng(at).integers(0, 255, chunk.nbytes, dtype=np.uint8)
        mapping.array[at : at + chunk.nbytes] = data
        expected.append(data)
    filled = Filled(None, offsets, mapping.array)  # type: ignore[arg-type]  # not read
    mapping.close()  # the worker dropped the replaced arena
    assert mapping.array.nbytes == 0
    got = ArenaJobs.job_bytes(filled, plan)
    assert np.array_equal(got, np.concatenate(expected))
    region.close()
