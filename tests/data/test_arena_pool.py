"""A worker's extent pool: all-or-nothing takes, refills that adapt to the jobs seen (and
to bursts of them) and stay within the budget, extents of a replaced arena never used."""

from __future__ import annotations

import torch

from tierstore.data.arena.pool import ExtentPool
from tierstore.data.extent_copy import Run, runs_of
from tierstore.data.layout import ChunkLayout


def test_take_is_all_or_nothing_and_refills_to_twice_the_largest_job() -> None:
    pool = ExtentPool(budget_bytes=10_000, epoch="a")
    assert pool.take([100, 100, 300]) is None and pool.misses == 1
    wanted = pool.wanted()
    assert sorted(wanted) == [100] * 4 + [300] * 2
    assert pool.wanted() == []  # asked already
    assert pool.add(wanted, list(range(0, 600, 100)), "a") == []
    got = pool.take([100, 300, 100])
    assert got is not None and len(set(got)) == 3
    assert sorted(pool.wanted()) == [100, 100, 300]


def test_refills_stay_within_the_budget() -> None:
    pool = ExtentPool(budget_bytes=1000, epoch="a")
    pool.take([400] * 3)
    wanted = pool.wanted()
    assert wanted == [400, 400]
    pool.add(wanted, [None, 0], "a")  # the arena was short of room for one
    assert pool.held_bytes == 400
    assert pool.wanted() == [400]  # the refused one is asked for again
    assert pool.wanted() == []  # 400 held, 400 asked: another would pass the budget


def test_extents_of_a_replaced_arena_are_given_back_not_used() -> None:
    pool = ExtentPool(budget_bytes=1000, epoch="a")
    pool.take([100])
    wanted = pool.wanted()
    assert pool.reset("b") == []
    assert pool.add(wanted, [0, 100], "a") == [0, 100]
    assert pool.take([100]) is None


def test_a_burst_of_jobs_between_refills_grows_the_pool_to_twice_the_burst() -> None:
    pool = ExtentPool(budget_bytes=10_000, epoch="a")
    pool.add(pool.wanted(), [], "a")  # nothing yet
    pool.take([100])
    first = pool.wanted()
    assert first == [100, 100]
    pool.add(first, [0, 100], "a")
    # A step submits three stores before the next refill answer: the third misses.
    assert pool.take([100]) is not None and pool.take([100]) is not None
    assert pool.take([100]) is None
    refill = pool.wanted()
    assert refill == [100] * 6  # twice the burst of three, none left in the pool
    pool.add(refill, list(range(200, 800, 100)), "a")
    assert all(pool.take([100]) is not None for _ in range(3))  # the next burst fits


def test_extents_granted_back_to_back_are_taken_in_order_so_a_job_copies_as_one_run() -> None:
    """A fresh arena grants ascending, adjacent extents: a job that takes them in that
    order has its chunks back to back in the arena too, one copy instead of one per
    chunk (34 chunks: 7x the time, measured)."""
    layout = ChunkLayout([torch.zeros(64, 128, dtype=torch.int8)], [[(0, 128)]], 2)
    plan = layout.plan([16], [0])  # 8 chunks of 256 bytes
    sizes = [c.nbytes for c in plan.chunks]
    pool = ExtentPool(budget_bytes=1 << 20, epoch="a")
    pool.take(sizes)
    wanted = pool.wanted()
    pool.add(wanted, [i * 256 for i in range(len(wanted))], "a")
    first, second = pool.take(sizes), pool.take(sizes)
    assert first is not None and second is not None
    assert runs_of(plan.chunks, first) == [Run(0, plan.nbytes, 0)]
    assert runs_of(plan.chunks, second) == [Run(0, plan.nbytes, plan.nbytes)]


def test_a_commits_answer_replenishes_the_pool_up_to_its_target_and_no_further() -> None:
    """A steady stream of stores refills from its commits' answers: the pool is short
    only when another job would miss, and extents beyond its target (an answer to a
    refill came meanwhile) or of a replaced arena are given back."""
    pool = ExtentPool(budget_bytes=10_000, epoch="a")
    pool.take([100, 100])
    pool.add(pool.wanted(), [0, 100, 200, 300], "a")  # two jobs' worth
    assert pool.take([100, 100]) == [0, 100]
    assert not pool.short([100, 100])  # one job left: its commit's answer refills
    assert pool.replenish([100, 100], [400, 500], "a") == []
    assert pool.held_bytes == 400 and pool.wanted() == []
    assert pool.replenish([100], [600], "a") == [600]  # beyond twice the job
    assert pool.replenish([100, 100], [None, 700], "b") == [700]  # another arena's
    assert pool.take([100, 100]) is not None and pool.take([100, 100]) is not None
    assert pool.short([100, 100]) and pool.take([100, 100]) is None
