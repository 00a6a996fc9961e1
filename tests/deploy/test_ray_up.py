"""``ray up`` launched for real: Ray's cluster launcher and autoscaler, with the fake
multi-node provider, on ``deploy/fake_cluster.yaml`` (a mirror of ``ray_cluster.yaml``).

One run of ``tierstore.deploy.ray_up_check`` (about 1.5 to 2 minutes): ``ray up`` sets up the
head (``ray start --head`` with token auth and the autoscaler, then ``tierstore up``),
the autoscaler brings up one worker, then a second on request; a NodeStore must run on
every one of them (the late one too) at niceness 0 and ``tierstore status`` must list
them; the control-plane benchmark runs with ``ray job submit``; ``ray down`` must leave
no process of the cluster, no tierstore actor process and no arena or lock file (the
last is a known failure, marked so: the NodeStores' arenas outlive ``ray down``).
"""

from __future__ import annotations

from typing import Any

import pytest
from tierstore.deploy.ray_up_check import run_check


@pytest.fixture(scope="module")
def summary() -> dict[str, Any]:
    return run_check()


def test_ray_up_check_passes_but_for_the_arena_files(summary: dict[str, Any]) -> None:
    shown = {k: v for k, v in summary.items() if k != "log_tail"}
    assert "error" not in summary, f"{shown}\n{summary.get('log_tail', '')}"


def test_a_node_store_on_every_node_including_one_that_joined_later(
    summary: dict[str, Any],
) -> None:
    at_start = {n["node_id"] for n in summary["nodes_at_start"]}
    nodes = {n["node_id"] for n in summary["nodes"]}
    assert len(at_start) == 2 and len(nodes) == 3 and at_start < nodes
    assert sum(n["head"] for n in summary["nodes"]) == 1
    assert set(summary["node_stores"]) == nodes
    table = summary["tierstore_status"]
    assert sum(line.split()[1:2] == ["cpu"] for line in table.splitlines()) == 3, table


def test_workers_are_on_loopback_and_every_actor_unniced(summary: dict[str, Any]) -> None:
    # The head's `ray start` resolves 127.0.0.1 to the machine's address (fake_cluster.yaml).
    assert {n["ip"] for n in summary["nodes"] if not n["head"]} == {"127.0.0.1"}
    titles = [a["title"] for a in summary["actor_processes"].values()]
    assert titles.count("ray::NodeStore") == 3 and "ray::Evictor" in titles, titles
    assert {a["nice"] for a in summary["actor_processes"].values()} == {0}


def test_the_benchmark_job_ran_on_the_launched_cluster(summary: dict[str, Any]) -> None:
    job = summary["job"]
    assert job["ray_cluster"].endswith(summary["gcs"].rsplit(":", 1)[1])
    assert [r["keys_per_request"] for r in job["rows"]] == [16, 256]
    assert all(r["hit_fraction"] == 1.0 for r in job["rows"])


def test_ray_down_leaves_no_process_behind(summary: dict[str, Any]) -> None:
    assert summary["cleanup"]["cluster_processes"] == []
    assert summary["cleanup"]["actor_processes"] == {}
    assert summary["killed_after"] == []  # nothing was left for the check to stop


@pytest.mark.xfail(
    strict=True,
    reason="known: `ray down` ends the NodeStores with their raylet (no shutdown hook "
    "runs), so each node's arena stays in /dev/shm until a NodeStore starts there again",
)
def test_ray_down_leaves_no_arena_or_lock_file_behind(summary: dict[str, Any]) -> None:
    assert summary["cleanup"]["arena_and_lock_files"] == []
