"""How a node's tier is split among the Evictor shards, round by round (no Ray, no I/O).

Each Evictor shard admits and evicts within its share of every node's tiers. A static
split (``total // S`` each) leaves most of a node idle when traffic goes to one shard's
prefix trees (one hot system prompt). :func:`plan_shares` moves credit between shards
from their pressure on the node in the last round:

- a shard under pressure (it evicted or refused stores for the node, and its share is
  nearly full: :data:`FULL`) wants more;
- a shard under none that was asked for anything in the round (``active``: lookups or
  stores) keeps what it holds plus a floor of free room (so it can still admit without
  evicting), never less than the floor (:func:`share_floor`); one that was not (its
  chunks are the node's least recently used: one LRU over the node would evict them
  first) keeps the floor; the rest of either's share is credit for the pressured ones;
- the pressured shards split what the others do not keep in proportion to their
  pressure (the bytes each needed: one LRU over the whole node would give each prefix
  population room in proportion to the rate at which it brings new bytes), each at
  least the floor;
- at most ``max_move`` bytes change hands in a round, so shares follow a shift of
  traffic in a few rounds rather than flapping with each.

Without pressure nothing moves. The plan is targets; who executes it shrinks the givers
first and grows the takers only by what the givers confirmed they no longer hold
(:class:`tierstore.store.evictor_shards.ShareBalancer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "FLOOR_PARTS",
    "FULL",
    "MOVE_PARTS",
    "TierLoad",
    "plan_shares",
    "share_floor",
]

# A share is nearly full past this fraction (a CPU tier's low watermark is 0.85 by
# default: a shard that demotes to it has its share this full).
FULL = 0.8
# Each shard keeps at least 1/(FLOOR_PARTS * S) of the node's tier.
FLOOR_PARTS = 4
# A round moves at most 1/MOVE_PARTS of the tier.
MOVE_PARTS = 4


class TierLoad(NamedTuple):
    """One Evictor shard's part of one node tier: its share (``capacity``), the bytes it
    counts there (``used``; above ``capacity`` only while a shrink could not evict all,
    such as leased chunks), and its ``pressure`` since the last round (shards it evicted
    or refused to make room for the node's stores; 0: none); ``active``: it was asked
    for anything (lookups, stores) since the last round."""

    capacity: int
    used: int
    pressure: int = 0
    active: bool = True

    @property
    def claim(self) -> int:
        """The bytes of the tier this shard may hold now: its share, or what it holds
        if that is more."""
        return max(self.capacity, self.used)

    @property
    def pressured(self) -> bool:
        return self.pressure > 0 and self.used >= FULL * self.capacity


def share_floor(total: int, shards: int) -> int:
    """The least share of a ``total``-byte tier any of ``shards`` shards keeps."""
    return total // (FLOOR_PARTS * shards) if shards > 0 else total


def plan_shares(loads: Sequence[TierLoad], total: int, floor: int, max_move: int) -> list[int]:
    """Each shard's target share of a ``total``-byte tier (see the module docstring).

    The targets add up to ``total`` when any shard is pressured (else they are the
    current shares); a shard's target differs from its share by at most ``max_move``,
    and the bytes taken from shards in all add up to at most ``max_move``.
    """
    caps = [load.capacity for load in loads]
    hungry = [i for i, load in enumerate(loads) if load.pressured]
    if not hungry or total <= 0:
        return caps
    floor = max(0, min(floor, total // len(loads)))
    targets = list(caps)
    for i, load in enumerate(loads):
        if i in hungry:
            continue
        if load.active:  # keeps what it holds and a floor of room, at least the floor
            targets[i] = max(floor, min(load.capacity, load.used + floor))
        else:
            targets[i] = min(load.capacity, floor)
    pool = total - sum(targets[i] for i in range(len(loads)) if i not in hungry)
    weight = sum(loads[i].pressure for i in hungry)
    given = 0
    for n, i in enumerate(hungry):
        if n == len(hungry) - 1:
            targets[i] = pool - given  # the rounding's remainder to the last
        else:
            targets[i] = pool * loads[i].pressure // weight
        given += targets[i]
    _lift_to_floor(targets, hungry, floor)
    return _limit(caps, targets, total, max_move)


def _lift_to_floor(targets: list[int], hungry: list[int], floor: int) -> None:
    """Raise the pressured shards' targets below ``floor`` to it, taking from the
    largest targets above it (the sum stays)."""
    for i in hungry:
        short = floor - targets[i]
        while short > 0:
            j = max(range(len(targets)), key=lambda k: targets[k])
            spare = min(short, targets[j] - floor)
            if spare <= 0:
                return
            targets[j] -= spare
            targets[i] += spare
            short -= spare


def _limit(caps: list[int], targets: list[int], total: int, max_move: int) -> list[int]:
    """Move each share from ``caps`` toward ``targets``: the givers' cuts scaled so they
    add up to at most ``max_move``, then the takers' gains (in proportion to what each
    wants) to at most ``max_move`` and to what the cuts and the unclaimed rest of the
    tier leave, so the result never adds up to more than ``total``."""
    out = list(caps)
    taken = sum(c - t for c, t in zip(caps, targets, strict=True) if t < c)
    if taken:
        budget = min(taken, max_move)
        for i, (c, t) in enumerate(zip(caps, targets, strict=True)):
            if t < c:
                out[i] = c - (c - t) * budget // taken
    gained = sum(t - c for c, t in zip(caps, targets, strict=True) if t > c)
    room = total - sum(out)
    budget = min(gained, max_move, max(0, room))
    if gained and budget:
        for i, (c, t) in enumerate(zip(caps, targets, strict=True)):
            if t > c:
                out[i] = c + (t - c) * budget // gained
    return out
