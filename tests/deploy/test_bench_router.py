"""The router benchmark's parts that need no cluster: Ray's prefix router sees token-id
prompts as the text they stand for, and the table reports what the runs measured. The
benchmark itself (``python -m tierstore.deploy.bench router --quick``) starts six
engines, minutes on two cores: it is run by hand, not here."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve.llm", reason="Ray Serve is not installed (the [serve] extra)")

from tierstore.deploy.bench.router import (
    TokenPrefixCacheAffinityRouter,
    markdown,
    same_outputs,
    summarize,
    table,
)


def _text(prompt: Any) -> str:
    router = object.__new__(TokenPrefixCacheAffinityRouter)  # its policy's state unused
    request = SimpleNamespace(args=[SimpleNamespace(prompt=prompt)], kwargs={})
    text: str = router._extract_text_from_request(request)
    return text


def test_the_prefix_router_sees_shared_token_prefixes_as_shared_text() -> None:
    a, b, c = _text([5, 6, 7, 8]), _text([5, 6, 7, 9]), _text([1, 6, 7, 8])
    assert len(a) == 4 and a[:3] == b[:3] and a != b
    assert a[0] != c[0]  # another first token: no common prefix
    assert _text("plain text") == "plain text"  # text prompts as Ray reads them


def _request(ttft_s: float, prompt: int, cached: int | None, tokens: list[int]) -> dict[str, Any]:
    return {"ttft_s": ttft_s, "prompt_tokens": prompt, "cached_tokens": cached, "tokens": tokens}


def test_the_table_reports_ttft_hit_rate_and_the_same_node_share() -> None:
    requests = [
        _request(0.1, 100, 0, [1]),
        _request(0.3, 300, 200, [2]),
        _request(0.2, 100, None, [3]),
    ]
    before = {"hits_same_node": 5, "hits_other_node": 1, "loaded_chunks": 2}
    after = {"hits_same_node": 8, "hits_other_node": 2, "loaded_chunks": 6}
    summary = summarize(requests, before, after)
    assert summary["hit_rate"] == pytest.approx(200 / 500)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["ttft_ms"]["p99"] == pytest.approx(300.0)
    assert summary["same_node_share"] == pytest.approx(3 / 4)
    assert summary["tierstore_loaded_tokens"] == 4 * 32
    runs = {"a": {"summary": summary, "requests": requests}}
    (row,) = table(runs)
    assert row["tierstore_hits_same_node_pct"] == 75.0 and row["requests"] == 3
    assert "| a | 200.0 | 300.0 | 0.4 | 75.0 (4) | 3 |" in markdown([row])
    other = [dict(r) for r in requests]
    assert same_outputs(runs | {"b": {"summary": summary, "requests": other}})
    other[1]["tokens"] = [9]
    assert not same_outputs(runs | {"b": {"summary": summary, "requests": other}})
