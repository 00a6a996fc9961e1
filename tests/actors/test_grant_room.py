"""The arena's room for extents lent to workers scales with the CPU tier, so a worker's
pool (half the room) holds a large GPU store job instead of sending it through the
object store; small tiers keep a room no larger than themselves."""

from __future__ import annotations

from tierstore.actors.node_store_actor import grant_room

MiB, GiB = 1 << 20, 1 << 30


def test_a_large_tier_lends_enough_for_a_32k_token_job_of_an_8b_model() -> None:
    job = 32 * 1024 * 128 * 1024  # 32k tokens x 128 KiB of KV per token (8B Llama, bf16)
    assert job == 4 * GiB
    assert grant_room(80 * GiB) // 2 >= job  # the pool's half of the room
    assert grant_room(80 * GiB) == 10 * GiB  # an eighth: the arena is 1.125x the tier


def test_small_tiers_keep_at_least_256_mib_but_never_more_than_themselves() -> None:
    assert grant_room(1 * GiB) == 256 * MiB
    assert grant_room(4 * MiB) == 4 * MiB
