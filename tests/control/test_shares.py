"""How credit moves between Evictor shards' shares of a node tier (plan_shares): no Ray.

What a serving engineer cares about: traffic skewed to one shard's prefix trees gets
(nearly) the whole tier within a few rounds, a cold shard keeps a floor it can admit
into, nothing moves without pressure, and no plan asks for more than the tier.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.control.shares import FULL, TierLoad, plan_shares, share_floor

TOTAL = 1 << 20


def _rounds(
    loads: list[TierLoad], rounds: int, pressure: list[int], active: list[bool] | None = None
) -> list[int]:
    """Shares after ``rounds`` rounds where shard i brings ``pressure[i]`` each round and
    fills whatever share it has (pressure 0: it holds nothing new), asked for anything
    when ``active[i]`` (default: when it has pressure)."""
    active = active or [p > 0 for p in pressure]
    caps = [load.capacity for load in loads]
    used = [load.used for load in loads]
    floor = share_floor(TOTAL, len(caps))
    for _ in range(rounds):
        loads = [
            TierLoad(c, c if p else min(u, c), p, a)
            for c, u, p, a in zip(caps, used, pressure, active, strict=True)
        ]
        caps = plan_shares(loads, TOTAL, floor, TOTAL // 4)
        assert sum(caps) <= TOTAL
        used = [min(u, c) for u, c in zip(used, caps, strict=True)]
    return caps


def test_skewed_traffic_gets_all_but_the_cold_shards_floor() -> None:
    half = TOTAL // 2
    caps = _rounds([TierLoad(half, half), TierLoad(half, 0)], 6, [100, 0])
    floor = share_floor(TOTAL, 2)
    assert caps == [TOTAL - floor, floor]


def test_a_cold_shard_keeps_what_it_holds_and_room_to_admit() -> None:
    half = TOTAL // 2
    held = TOTAL // 5
    floor = share_floor(TOTAL, 2)
    caps = _rounds([TierLoad(half, half), TierLoad(half, held)], 6, [100, 0], [True, True])
    assert caps[1] == held + floor
    assert caps[0] == TOTAL - held - floor


def test_an_idle_shard_keeps_the_floor_however_much_it_holds() -> None:
    half = TOTAL // 2
    floor = share_floor(TOTAL, 2)
    caps = _rounds([TierLoad(half, half), TierLoad(half, half)], 6, [100, 0], [True, False])
    assert caps == [TOTAL - floor, floor]


def test_shares_follow_when_traffic_moves_to_the_other_shard() -> None:
    floor = share_floor(TOTAL, 2)
    caps = _rounds([TierLoad(TOTAL - floor, TOTAL - floor), TierLoad(floor, floor)], 8, [0, 50])
    assert caps == [floor, TOTAL - floor]


def test_both_pressured_split_in_proportion_to_their_pressure() -> None:
    loads = [TierLoad(TOTAL // 2, TOTAL // 2, 300), TierLoad(TOTAL // 2, TOTAL // 2, 100)]
    caps = plan_shares(loads, TOTAL, share_floor(TOTAL, 2), TOTAL)
    assert caps == [TOTAL * 3 // 4, TOTAL - TOTAL * 3 // 4]


def test_nothing_moves_without_pressure_or_while_a_share_has_room() -> None:
    loads = [TierLoad(TOTAL // 2, TOTAL // 4, 0), TierLoad(TOTAL // 2, TOTAL // 2, 0)]
    assert plan_shares(loads, TOTAL, share_floor(TOTAL, 2), TOTAL) == [TOTAL // 2] * 2
    # evicted, but its share was not nearly full (a store larger than the room left)
    loads = [TierLoad(TOTAL // 2, int(TOTAL // 2 * FULL) - 1, 5), TierLoad(TOTAL // 2, 0, 0)]
    assert plan_shares(loads, TOTAL, share_floor(TOTAL, 2), TOTAL) == [TOTAL // 2] * 2


def test_a_round_moves_at_most_max_move() -> None:
    half = TOTAL // 2
    caps = plan_shares([TierLoad(half, half, 9), TierLoad(half, 0)], TOTAL, 0, TOTAL // 16)
    assert caps == [half + TOTAL // 16, half - TOTAL // 16]


loads_st = st.lists(
    st.tuples(st.integers(0, TOTAL), st.integers(0, TOTAL), st.integers(0, 1000), st.booleans()),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(raw=loads_st, move=st.integers(0, TOTAL), floor_parts=st.integers(1, 16))
def test_a_plan_never_asks_more_than_the_tier_and_keeps_floors(
    raw: list[tuple[int, int, int, bool]], move: int, floor_parts: int
) -> None:
    # shares that add up to at most the tier, as the NodeStore registers them
    scale = max(1, sum(c for c, _, _, _ in raw))
    loads = [TierLoad(c * TOTAL // scale, u, p, a) for c, u, p, a in raw]
    floor = TOTAL // (floor_parts * len(loads))
    caps = [load.capacity for load in loads]
    plan = plan_shares(loads, TOTAL, floor, move)
    assert len(plan) == len(loads)
    assert all(p >= 0 for p in plan)
    assert sum(plan) <= TOTAL
    assert sum(c - p for c, p in zip(caps, plan, strict=True) if p < c) <= move
    assert sum(p - c for c, p in zip(caps, plan, strict=True) if p > c) <= move
    if not any(load.pressured for load in loads):
        assert plan == caps
    for cap, p in zip(caps, plan, strict=True):
        if p < cap:  # a giver: never below the floor (an active one's room: see above)
            assert p >= min(cap, floor)
