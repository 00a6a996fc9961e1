"""The processes of one Ray cluster on this machine, found and stopped by its temp dir.

``ray stop`` stops every Ray cluster on the machine; other sessions may run theirs. A
cluster started with its own ``--temp-dir`` is told apart by it: every raylet, GCS and
agent names its session directory on its command line, and the workers (whose titles,
``ray::NodeStore`` and the like, name nothing) are their descendants. Used by the fake
cluster's node provider (:mod:`tierstore.deploy.fake_provider`, its ``ray stop``), by
the ``ray up`` check, and by the tests' private Ray heads. Needs ``psutil`` (Ray's
dependency) and nothing of Ray's or tierstore's.
"""

from __future__ import annotations

import os
import signal

import psutil  # type: ignore[import-untyped]  # Ray's dependency (also vendored)

STOP_GRACE_S = 10.0  # SIGTERM's grace before SIGKILL, per group of processes


def cluster_processes(scope: str) -> list[psutil.Process]:
    """This cluster's processes: those whose command line names ``scope`` (its Ray temp
    dir) and all their descendants. The caller and its parents are never included."""
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid in mine or not any(scope in arg for arg in proc.info["cmdline"] or []):
            continue
        found[proc.pid] = proc
        try:
            found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return [p for pid, p in found.items() if pid not in mine]


def signal_and_wait(procs: list[psutil.Process], grace_s: float) -> list[psutil.Process]:
    """SIGTERM, then after ``grace_s`` SIGKILL; returns those still alive after both.
    Blocks up to ``2 * grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
        if not procs:
            break
    return procs


def stop_cluster(scope: str, grace_s: float = STOP_GRACE_S) -> list[psutil.Process]:
    """``ray stop`` for one cluster: the raylets first (their workers exit with them),
    then everything else of ``scope``, the GCS last, as ``ray stop`` orders them; each
    group SIGTERM, then SIGKILL after ``grace_s``. Returns what is still alive. Blocks
    up to about ``6 * grace_s``."""
    procs = cluster_processes(scope)
    raylets = [p for p in procs if _named(p, "raylet")]
    gcs = [p for p in procs if _named(p, "gcs_server")]
    rest = [p for p in procs if p not in raylets and p not in gcs]
    left = []
    for bucket in (raylets, rest, gcs):
        left += signal_and_wait(bucket, grace_s)
    return left + [p for p in cluster_processes(scope) if p not in left]


def _named(proc: psutil.Process, name: str) -> bool:
    try:
        return proc.name() == name or any(os.path.basename(a) == name for a in proc.cmdline()[:1])
    except psutil.Error:
        return False
