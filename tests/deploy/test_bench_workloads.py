"""The end-to-end benchmark's workloads have the shapes they claim, its accounting adds up,
and its headline ratios compare the engines they name."""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
from tierstore.deploy.bench.e2e import BIND_ENV, omp_binding, pooled, run_order, summarize, targets
from tierstore.deploy.bench.e2e_engine import metric_delta, metric_totals
from tierstore.deploy.bench.standard import setup, table
from tierstore.deploy.bench.workloads import (
    ChatRequest,
    MultiRound,
    MultiTurn,
    PrefixHit,
    PrefixRepetition,
    Unique,
)


def test_prefix_repetition_sends_each_prefix_repeats_times_with_fresh_suffixes() -> None:
    workload = PrefixRepetition(num_prefixes=3, prefix_len=64, suffix_len=16, repeats=4)
    sent: list[list[int]] = []
    workload.run(lambda p: sent.append(p) or [])
    assert len(sent) == 12 and all(len(p) == 80 for p in sent)
    prefixes = {tuple(p[:64]) for p in sent}
    assert len(prefixes) == 3
    assert all(sum(tuple(p[:64]) == q for p in sent) == 4 for q in prefixes)
    assert len({tuple(p[64:]) for p in sent}) == 12
    # Shuffled: not all repeats of one prefix back to back.
    assert [tuple(p[:64]) for p in sent] != sorted(tuple(p[:64]) for p in sent)


def test_long_document_qa_orders_are_vllms_repeat_modes() -> None:
    shape = {"num_prefixes": 3, "prefix_len": 64, "suffix_len": 8, "repeats": 2}

    def documents(order: str) -> list[int]:
        prompts = PrefixRepetition(**shape, order=order).prompts()
        assert len(prompts) == 6 and all(len(p) == 72 for p in prompts)
        assert len({tuple(p[64:]) for p in prompts}) == 6  # every query its own question
        firsts = [tuple(p[:64]) for p in prompts]
        return [sorted(set(firsts), key=firsts.index).index(d) for d in firsts]

    assert documents("interleave") == [0, 0, 1, 1, 2, 2]  # each document's queries together
    assert documents("tile") == [0, 1, 2, 0, 1, 2]
    shuffled = documents("random")
    assert sorted(shuffled) == [0, 0, 1, 1, 2, 2] and shuffled != [0, 0, 1, 1, 2, 2]
    # The same documents and questions whatever the order; the same seed, the same prompts.
    assert sorted(PrefixRepetition(**shape, order="tile").prompts()) == sorted(
        PrefixRepetition(**shape).prompts()
    )
    assert PrefixRepetition(**shape).prompts() == PrefixRepetition(**shape).prompts()
    with pytest.raises(ValueError, match="unknown order"):
        PrefixRepetition(**shape, order="sorted").prompts()


def _serve(session: Any, service_s: float, answer_len: int = 3) -> list[tuple[float, ChatRequest]]:
    """A simulated engine on a virtual clock: every request is answered ``service_s``
    after it is sent (answer tokens: 9000 + its index). Returns (sent at, request)."""
    now, sent, in_flight = 0.0, [], []
    while not session.done:
        for request in session.due(now):
            sent.append((now, request))
            in_flight.append((now + service_s, request))
        next_s = session.next_s()
        times = [t for t, _ in in_flight] + ([next_s] if next_s is not None else [])
        now = max(now, min(times))
        for t, request in [x for x in in_flight if x[0] <= now]:
            in_flight.remove((t, request))
            session.answered(request, [9000 + request.index] * answer_len)
    return sent


def test_multi_round_shares_one_system_prompt_and_grows_each_users_history() -> None:
    workload = MultiRound(
        users=3, rounds=3, system_len=40, user_info_len=20, question_len=5, qps=10.0
    )
    sent = [r for _, r in _serve(workload.session(), service_s=0.01)]
    assert len(sent) == 9 and len({r.index for r in sent}) == 9
    first = [r for r in sent if r.round == 0]
    assert len({tuple(r.prompt[:40]) for r in first}) == 1  # the shared system prompt
    assert len({tuple(r.prompt[40:60]) for r in first}) == 3  # each user's own context
    for r in sent:
        if r.round == 0:
            assert len(r.prompt) == 65
            continue
        last = next(p for p in sent if p.user == r.user and p.round == r.round - 1)
        answer = [9000 + last.index] * 3
        assert r.prompt[: len(last.prompt) + 3] == last.prompt + answer  # history + answer
        assert len(r.prompt) == len(last.prompt) + 3 + 5  # + the new question
    # Seeded: a second session sends the same prompts.
    again = [r for _, r in _serve(workload.session(), service_s=0.01)]
    assert [r.prompt for r in again] == [r.prompt for r in sent]


def test_multi_round_is_paced_at_qps_and_waits_for_each_users_answer() -> None:
    workload = MultiRound(users=4, rounds=3, system_len=8, user_info_len=8, question_len=2, qps=2.0)
    fast = _serve(workload.session(), service_s=0.1)  # answers well within a user's gap
    assert [t for t, _ in fast] == pytest.approx([k / 2.0 for k in range(12)])
    assert [r.user for _, r in fast] == [0, 1, 2, 3] * 3  # users take turns at 2 requests/s
    assert all(r.scheduled_s == t for t, r in fast)
    # Answers slower than a user's gap (4 users / 2 qps = 2 s): a user asks again only once
    # its answer is in, so its requests go late, never two at once.
    slow = _serve(workload.session(), service_s=3.0)
    for user in range(4):
        times = [t for t, r in slow if r.user == user]
        assert all(b - a >= 3.0 for a, b in itertools.pairwise(times))
    assert any(t > r.scheduled_s for t, r in slow)


def test_standard_benchmarks_size_the_working_set_over_the_device_cache() -> None:
    for model in ("tiny", "0.1b"):
        for quick in (False, True):
            longdoc = setup("longdoc", model, quick)
            device_tokens = (longdoc["device_blocks"] - 1) * 32  # vLLM keeps one block back
            assert set(longdoc["workloads"]) == {"random", "interleave"}
            seeds = {w["params"]["seed"] for w in longdoc["workloads"].values()}
            assert len(seeds) == 2  # each order its own documents: neither warms the other
            params = longdoc["workloads"]["random"]["params"]
            assert params["num_prefixes"] * params["prefix_len"] > device_tokens
            chat = setup("multiround", model, quick)
            p = chat["workloads"]["multi_round"]["params"]
            history = p["user_info_len"] + p["rounds"] * (p["question_len"] + chat["max_tokens"])
            assert p["system_len"] + p["users"] * history > device_tokens
    assert (
        setup("multiround", "tiny", False, ["qps=0.5"])["workloads"]["multi_round"]["params"]["qps"]
        == 0.5
    )
    with pytest.raises(ValueError, match="over"):
        setup("longdoc", "tiny", True, ["prefix_len=4096"])


def test_standard_table_reports_ttft_throughput_and_every_tier_against_no_connector() -> None:
    def engine(cached: int, loaded: int, disk: int = 0) -> dict[str, Any]:
        requests = [
            {"prompt_tokens": 128, "cached_tokens": cached, "output_tokens": 2, "ttft_s": t}
            for t in (0.01 * i for i in range(1, 101))
        ]
        # The scheduler's loads by tier (the Evictor's counters say nothing of disk here).
        metrics = {
            'tierstore:loaded_chunks{tier="cpu"}': loaded - disk,
            'tierstore:loaded_chunks{tier="disk"}': disk,
        }
        tierstore = {"loaded_chunks": loaded}
        raw = {"wall_s": 4.0, "requests": requests, "tierstore": tierstore, "metrics": metrics}
        return {"random": summarize(raw)}

    rows = table({"no_connector": engine(0, 0), "tierstore": engine(96, 200, disk=50)})
    assert [(r["workload"], r["engine"]) for r in rows] == [
        ("random", "no_connector"),
        ("random", "tierstore"),
    ]
    off, on = rows
    assert off["ttft_ms_p50"] == pytest.approx(510.0) and off["ttft_ms_p99"] == pytest.approx(990.0)
    assert off["requests_per_s"] == 25.0 and off["prompt_tokens_per_s"] == 3200.0
    assert off["hit_rate"] == {"device": 0, "tierstore_cpu": 0, "tierstore_disk": 0, "miss": 1}
    # 200 chunks of 32 tokens loaded (50 from disk) of 9,600 tokens cached.
    assert on["hit_rate"] == pytest.approx(
        {"device": 0.25, "tierstore_cpu": 0.375, "tierstore_disk": 0.125, "miss": 0.25}
    )


def test_engine_metrics_keep_each_tiers_count() -> None:
    from prometheus_client import REGISTRY, Counter

    before = metric_totals()
    probe = Counter("tierstore:bench_probe", "a probe", ["tier", "engine"])
    try:
        probe.labels(tier="cpu", engine="0").inc(3)
        probe.labels(tier="disk", engine="0").inc(2)
        probe.labels(tier="disk", engine="1").inc(1)
        got = metric_delta(metric_totals(), before)
    finally:
        REGISTRY.unregister(probe)
    assert got["tierstore:bench_probe"] == 6
    assert got['tierstore:bench_probe{tier="cpu"}'] == 3
    assert got['tierstore:bench_probe{tier="disk"}'] == 3


def test_multi_turn_extends_the_previous_prompt_and_answer_round_robin() -> None:
    workload = MultiTurn(conversations=2, turns=3, system_len=40, user_len=8)
    answers = iter(range(1000, 2000))

    def generate(prompt: list[int]) -> list[int]:
        return [next(answers), next(answers)]

    sent = workload.run(generate)
    assert [len(p) for p in sent] == [48, 48, 58, 58, 68, 68]
    for i in range(2, 6):
        previous, prompt = sent[i - 2], sent[i]  # the same conversation's last turn
        answer = [1000 + 2 * (i - 2), 1000 + 2 * (i - 2) + 1]
        assert prompt[: len(previous) + 2] == previous + answer
    assert sent[0][:40] != sent[1][:40]  # each conversation has its own start


def test_unique_prompts_share_nothing() -> None:
    prompts = Unique(count=5, length=64).prompts()
    assert len({tuple(p[:32]) for p in prompts}) == 5


def test_summary_splits_prompt_tokens_by_where_they_came_from() -> None:
    raw = {
        "wall_s": 2.0,
        "requests": [
            {"prompt_tokens": 320, "cached_tokens": 0, "output_tokens": 4, "ttft_s": 0.2},
            {"prompt_tokens": 320, "cached_tokens": 288, "output_tokens": 4, "ttft_s": 0.1},
        ],
        # 6 chunks of 32 tokens loaded from tierstore, 2 of them promoted from disk first.
        "tierstore": {"loaded_chunks": 6, "promoted_shards": 2, "hits": 6, "misses": 3},
    }
    summary = summarize(raw, tokens_per_chunk=32)
    assert summary["tokens"] == {
        "device": 96,
        "tierstore_cpu": 128,
        "tierstore_disk": 64,
        "computed": 352,
    }
    assert summary["hit_rate"]["tierstore_disk"] == 64 / 640
    assert summary["prompt_tokens_per_s"] == 320.0


def test_prefix_hit_sends_pairs_sharing_a_prefix_and_forgets_between_the_two() -> None:
    events: list[str | list[int]] = []
    PrefixHit(pairs=2, prefix_len=64, suffix_len=8).run(
        lambda p: events.append(p) or [], lambda: events.append("forget")
    )
    assert [e if e == "forget" else len(e) for e in events] == [72, "forget", 72, 72, "forget", 72]
    miss, hit = events[0], events[2]
    assert miss[:64] == hit[:64] and miss[64:] != hit[64:]
    assert events[3][:64] != miss[:64]  # each pair its own prefix


def _engine(wall_s: float, hit_ttft_s: float) -> dict[str, Any]:
    request = {"prompt_tokens": 64, "cached_tokens": 0, "output_tokens": 1, "ttft_s": 0.1}
    unique = {"kind": "unique", "wall_s": wall_s, "requests": [request], "tierstore": {}}
    pairs = [request, dict(request, ttft_s=hit_ttft_s, cached_tokens=32)]
    prefix = {"kind": "prefix_hit", "wall_s": 1.0, "requests": pairs, "tierstore": {}}
    return {"unique": summarize(unique), "prefix_hit": summarize(prefix)}


def test_targets_compare_zero_hits_to_no_connector_and_hits_to_the_reference() -> None:
    summary = {
        "no_connector": _engine(wall_s=1.0, hit_ttft_s=0.4),
        "reference": _engine(wall_s=1.0, hit_ttft_s=0.1),
        "tierstore": _engine(wall_s=1.25, hit_ttft_s=0.2),
    }
    assert summary["tierstore"]["prefix_hit"]["hit_cached_fraction"] == 0.5
    got = targets(summary)
    assert got["zero_hit_time_vs_no_connector"] == 1.25
    assert got["zero_hit_throughput_vs_no_connector"] == 0.8
    assert got["hit_ttft_p50_vs_reference"] == 2.0
    assert got["hit_ttft_p50_vs_recompute"] == 0.5


def test_every_engine_is_pinned_alike_leaving_the_first_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BIND_ENV, raising=False)
    cores = sorted(os.sched_getaffinity(0))
    expected = ",".join(map(str, cores[1:])) if len(cores) > 1 else "nobind"
    assert omp_binding() == expected
    monkeypatch.setenv(BIND_ENV, "0-1")
    assert omp_binding() == "0-1"


def test_engines_run_forward_then_back_and_each_pools_its_runs() -> None:
    assert run_order(2) == [
        ("no_connector", 0),
        ("reference", 0),
        ("tierstore", 0),
        ("tierstore", 1),
        ("reference", 1),
        ("no_connector", 1),
    ]
    request = {"prompt_tokens": 64, "cached_tokens": 0, "output_tokens": 1, "ttft_s": 0.1}
    hit = dict(request, ttft_s=0.3, cached_tokens=32)

    def run(wall_s: float, loaded: int) -> dict[str, Any]:
        counters = {"loaded_chunks": loaded}
        return {"prefix_hit": {"kind": "prefix_hit", "wall_s": wall_s, "requests": [request, hit],
                               "tierstore": counters}}  # fmt: skip

    both = pooled([run(1.0, 1), run(3.0, 2)])["prefix_hit"]
    assert both["wall_s"] == 4.0 and both["tierstore"] == {"loaded_chunks": 3}
    summary = summarize(both)
    assert summary["requests"] == 4
    assert summary["hit_ttft_ms"]["p50"] == pytest.approx(300.0)  # misses and hits kept apart
    assert summary["prompt_tokens_per_s"] == 256 / 4.0
