"""tierstore's background threads leave the cores their creator is bound to (vLLM-CPU's
compute cores) for the others, and stay put where nothing is bound."""

from __future__ import annotations

import os
import threading

import pytest

from tierstore.vllm.cpu_affinity import (
    leave_compute_cores,
    parse_cpu_list,
    started_threads_leave_compute_cores,
    usable_cpus,
)


def _mask_of_a_thread_started_from(bound: set[int] | None) -> set[int]:
    """The affinity a thread ends with after ``leave_compute_cores``, when started from a
    thread bound to ``bound`` (None: not bound)."""
    seen: list[set[int]] = []

    def child() -> None:
        leave_compute_cores()
        seen.append(os.sched_getaffinity(0))

    def creator() -> None:
        if bound is not None:
            os.sched_setaffinity(0, bound)
        thread = threading.Thread(target=child)
        thread.start()
        thread.join()

    thread = threading.Thread(target=creator)
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.skipif(len(usable_cpus()) < 2, reason="needs two CPUs")
def test_a_thread_started_from_a_bound_thread_runs_on_the_other_cpus() -> None:
    cpus = usable_cpus()
    compute = {max(cpus)}
    assert _mask_of_a_thread_started_from(compute) == cpus - compute


def test_an_unbound_thread_stays_where_it_may_run() -> None:
    assert _mask_of_a_thread_started_from(None) == os.sched_getaffinity(0)


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert parse_cpu_list("0-3,8\n") == {0, 1, 2, 3, 8}
    assert parse_cpu_list("1") == {1}
    with pytest.raises(ValueError):
        parse_cpu_list("\n")


@pytest.mark.skipif(len(usable_cpus()) < 2, reason="needs two CPUs")
def test_threads_started_inside_the_block_leave_the_bound_cpus() -> None:
    """As ``ray.init`` in a bound vLLM-CPU worker: the threads it starts move; the
    caller stays where vLLM bound it."""
    cpus = usable_cpus()
    compute = {max(cpus)}
    seen: dict[str, set[int]] = {}

    def creator() -> None:
        os.sched_setaffinity(0, compute)
        release = threading.Event()
        started = threading.Thread(target=release.wait)
        with started_threads_leave_compute_cores():
            started.start()
        assert started.native_id is not None
        seen["started"] = os.sched_getaffinity(started.native_id)
        seen["caller"] = os.sched_getaffinity(0)
        release.set()
        started.join()

    thread = threading.Thread(target=creator)
    thread.start()
    thread.join()
    assert seen == {"started": cpus - compute, "caller": compute}
