"""tierstore's background threads in a vLLM-CPU worker run beside its OpenMP threads.

vLLM's CPU platform binds each worker's OpenMP threads, which spin, to its compute cores,
the model-runner thread with them, and a thread started from that thread inherits the
binding. tierstore's transfer, commit, refill and Evictor-channel threads (copies,
hashes, Ray calls) would then take turns with the forward on the compute cores while
the cores vLLM leaves free sit idle: vLLM keeps one for the front end and, when a KV
connector is set, tries to keep one more for it (its own NIXL connector binds its
transfer thread there). So each of those threads calls :func:`leave_compute_cores`
first, which moves it to the CPUs its creator is not bound to, and the threads Ray
starts in the worker when it connects (its RPC and event loops, which carry every
actor call) are moved there too (:func:`started_threads_leave_compute_cores`). Where
nothing is bound (a GPU worker, ``VLLM_CPU_OMP_THREADS_BIND=nobind``) or every core
is, it changes nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

_CPUSET = Path("/sys/fs/cgroup/cpuset.cpus.effective")
_reported = False


def leave_compute_cores() -> None:
    """Calling thread (at its start): run on the CPUs it is not bound to, if any. Never
    raises: a thread that cannot move runs where it was started."""
    global _reported
    try:
        bound = os.sched_getaffinity(0)
        free = usable_cpus() - bound
        if not free:
            return
        os.sched_setaffinity(0, free)
    except (AttributeError, OSError, ValueError) as exc:
        logger.debug("could not move a tierstore thread off the compute cores: %s", exc)
        return
    if not _reported:
        _reported = True
        logger.info(
            "tierstore's background threads run on CPUs %s, beside the compute threads on %s",
            sorted(free),
            sorted(bound),
        )


@contextmanager
def started_threads_leave_compute_cores() -> Iterator[None]:
    """The OS threads started inside this block (``ray.init``'s) leave the calling
    thread's CPUs for the others, as :func:`leave_compute_cores` does. Never raises."""
    before = _thread_ids()
    yield
    try:
        free = usable_cpus() - os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return
    if not free:
        return
    for tid in _thread_ids() - before:
        try:
            os.sched_setaffinity(tid, free)
        except OSError:  # ended already
            continue


def _thread_ids() -> set[int]:
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def usable_cpus() -> set[int]:
    """The CPUs this process may run on: its cgroup's cpuset, else every online CPU."""
    try:
        return parse_cpu_list(_CPUSET.read_text())
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"no CPUs in {text!r}")
    return cpus
