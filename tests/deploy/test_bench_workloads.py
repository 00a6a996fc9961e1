"""The end-to-end benchmark's workloads have the shapes they claim, its accounting adds up,
and its headline ratios compare the engines they name."""

from __future__ import annotations

import os
from typing import Any

import pytest
from tierstore.deploy.bench.e2e import BIND_ENV, omp_binding, pooled, run_order, summarize, targets
from tierstore.deploy.bench.workloads import MultiTurn, PrefixHit, PrefixRepetition, Unique


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
