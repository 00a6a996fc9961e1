"""Fixtures of the data-layer tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tierstore.data.arena.region import ArenaRegion
from tierstore.data.tiers.arena import ArenaTier


@pytest.fixture
def arena_tier() -> Iterator[ArenaTier]:
    """A CPU tier of 128 KiB in a fresh 256 KiB arena (a real shared mapping)."""
    region = ArenaRegion.create("ns-data", uuid.uuid4().hex, 256 << 10)
    tier = ArenaTier(region, capacity_bytes=128 << 10)
    yield tier
    region.close()


@pytest.fixture
def node() -> str:
    """A fresh node id: arena file names of one test never meet another's."""
    return uuid.uuid4().hex


@pytest.fixture
def regions() -> Iterator[list[ArenaRegion]]:
    """Arenas a test made (it appends them), closed after it: their files go."""
    made: list[ArenaRegion] = []
    yield made
    for region in made:
        region.close()
