"""The end-to-end benchmark's workloads have the shapes they claim, and its accounting adds up."""

from __future__ import annotations

from tierstore.deploy.bench.e2e import summarize
from tierstore.deploy.bench.workloads import MultiTurn, PrefixRepetition, Unique


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
