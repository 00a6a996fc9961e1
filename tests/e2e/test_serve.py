"""vLLM's OpenAI-compatible server with tierstore, driven over HTTP as a user would.

One server start (about a minute): a completion, a reset of the server's prefix cache and
of its connector (dev endpoint), then the same completion again, which tierstore serves.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tierstore.deploy.cli import collect_status
from tierstore.deploy.passes import random_prompt
from tierstore.deploy.serve import serve_command, shell_line, stop_server

from tests.e2e.conftest import (
    FP32_LOGPROB_TOL,
    MIN_CACHED_FRACTION,
    RAY_NAMESPACE,
    REPO,
    tierstore_extra,
)
from tests.support import free_port, poll, wait_for
from tierstore.errors import ConfigError

pytestmark = pytest.mark.e2e

PROMPT = random_prompt(1000, seed=53)  # no other test uses it: the first request is cold
_READY_TIMEOUT_S = 600  # about a minute alone; several on a loaded CI machine
_REQUEST_TIMEOUT_S = 300
_RESET_TIMEOUT_S = 60  # the reset fails while stores still hold device blocks
_METRICS_TIMEOUT_S = 10  # the engine's stats reach the API process with its outputs
_STOP_GRACE_S = 30
_LOG_TAIL_CHARS = 12_000
_EVENTS_TOPIC = "kv"


def _post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=_REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=_REQUEST_TIMEOUT_S) as response:
        return response.read().decode()


def _wait_ready(base: str, proc: subprocess.Popen[bytes]) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} before it was ready")
        try:
            urllib.request.urlopen(base + "/health", timeout=5).close()
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    wait_for(healthy, "the server healthy", _READY_TIMEOUT_S, poll_s=1)


@contextmanager
def _serving(argv: list[str], env: dict[str, str], log_path: Path) -> Iterator[str]:
    """Yields the server's base URL; any failure carries the command and the server's log."""
    port = argv[argv.index("--port") + 1]
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_ready(base, proc)
        yield base
    except Exception as exc:
        tail = log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        raise AssertionError(
            f"{exc}\n--- command ---\n{shell_line(argv)}\n--- server log (tail) ---\n{tail}"
        ) from exc
    finally:
        stop_server(proc, grace_s=_STOP_GRACE_S)


def _complete(base: str, model: str, prompt: list[int]) -> dict[str, Any]:
    """Greedy, 8 tokens, with the sampled tokens' log-probs; token ids in and out."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,  # no tokenizer: logprobs name tokens by id
    }
    response = _post(base + "/v1/completions", body)
    choice = response["choices"][0]
    details = response["usage"].get("prompt_tokens_details") or {}
    return {
        "tokens": choice["token_ids"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "cached_tokens": details.get("cached_tokens"),
    }


def _drain(base: str) -> None:
    """Until the engine has no connector work left: every store of the finished requests
    is acknowledged. vLLM's dev-mode ``/pause?mode=wait`` returns once the engine core has
    drained (its connector's pending jobs keep it stepping); ``/resume`` lets it go on."""
    assert _post(base + "/pause?mode=wait&clear_cache=false")["status"] == "paused"
    assert _post(base + "/resume")["status"] == "resumed"


def _reset(base: str, external: bool) -> None:
    """Retried: it fails while blocks are held, e.g. by stores still in flight."""
    url = base + "/reset_prefix_cache" + ("?reset_external=true" if external else "")
    wait_for(lambda: _post(url)["success"], f"{url} succeed", _RESET_TIMEOUT_S, poll_s=0.5)


def _tierstore_hits(base: str) -> dict[str, float]:
    """``tierstore:*hit*`` samples of /metrics (counters' ``_created`` lines left out)."""
    hits = {}
    for line in _get(base + "/metrics").splitlines():
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0]
        if metric.startswith("tierstore:") and "hit" in metric and "_created" not in metric:
            hits[name] = float(value)
    return hits


class _KVEvents:
    """Subscribes to the server's KV-event publisher (ZMQ) and keeps every event."""

    def __init__(self, port: int) -> None:
        import zmq

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.connect(f"tcp://127.0.0.1:{port}")
        self._socket.setsockopt(zmq.SUBSCRIBE, _EVENTS_TOPIC.encode())
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            self.events.extend(decoder.decode(payload).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)

    def offloaded(self) -> list[Any]:
        """Stores announced for tierstore's tiers (the device's own say medium GPU)."""
        return [
            e
            for e in self.events
            if type(e).__name__ == "BlockStored" and e.medium in ("CPU", "STORAGE")
        ]


def test_openai_server_serves_reset_prefix_from_tierstore(
    ray_cluster: str, tiny_model, tmp_path: Path
) -> None:
    model = tiny_model("llama", "float32")
    events_port = free_port()
    argv = serve_command(
        model,
        tierstore_extra(ray_address=ray_cluster),
        host="127.0.0.1",
        port=free_port(),
        dtype="float32",
        block_size=32,
        max_model_len=4096,
        enforce_eager=True,
        skip_tokenizer_init=True,  # the tiny models have no tokenizer; prompts are token ids
        enable_prompt_tokens_details=True,  # usage.prompt_tokens_details.cached_tokens
        kv_events_config=json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events_port}",
                "topic": _EVENTS_TOPIC,
            }
        ),
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache is a dev endpoint
    }
    with _serving(argv, env, tmp_path / "server.log") as base:
        kv_events = _KVEvents(events_port)
        before = collect_status(RAY_NAMESPACE)["totals"]  # the engine made the actors
        cold = _complete(base, model, PROMPT)
        _drain(base)  # the next request must find every chunk of this one stored
        _reset(base, external=False)  # succeeds once the stores have released their blocks
        _reset(base, external=True)  # the connector forgets its view; the chunks stay
        warm = _complete(base, model, PROMPT)
        # The manager reports loaded chunks to the Evictor one-way, through its channel,
        # after the load completes: the count may trail the response by a step or two.
        after = poll(
            lambda: collect_status(RAY_NAMESPACE)["totals"],
            _METRICS_TIMEOUT_S,
            poll_s=0.5,
            done=lambda t: (
                t["loaded_chunks"] - before["loaded_chunks"] >= warm["cached_tokens"] // 32
            ),
        )
        hits = poll(
            lambda: _tierstore_hits(base),
            _METRICS_TIMEOUT_S,
            poll_s=0.5,
            done=lambda found: any(found.values()),
        )

        # tierstore's residency changes reach the engine's KV-event stream once its manager
        # has polled the Evictor (at most once a second, on a scheduler step).
        def stepped_offloaded() -> object:
            if kv_events.offloaded():
                return kv_events.offloaded()
            _complete(base, model, PROMPT[:64])  # a step, so the manager polls and drains
            return None

        poll(stepped_offloaded, _METRICS_TIMEOUT_S, poll_s=1.0)
        kv_events.close()
        offloaded = kv_events.offloaded()

        assert cold["cached_tokens"] == 0
        assert warm["cached_tokens"] >= MIN_CACHED_FRACTION * len(PROMPT)
        assert len(warm["tokens"]) == 8
        assert warm["tokens"] == cold["tokens"]
        diff = max(abs(a - b) for a, b in zip(warm["logprobs"], cold["logprobs"], strict=True))
        assert diff <= FP32_LOGPROB_TOL
        # The cached tokens were loaded from tierstore's chunks (32 tokens each here).
        assert after["loaded_chunks"] - before["loaded_chunks"] >= warm["cached_tokens"] // 32
        assert after["hits"] > before["hits"]
        # Needs TierStoreSpec.build_metric_definitions (tierstore:lookup_hits and co.).
        assert any(value > 0 for value in hits.values()), f"no tierstore hits in /metrics: {hits}"
        # KV events: the prompt's chunks, announced with tierstore's medium and locality.
        announced = {h for e in offloaded for h in e.block_hashes}
        assert len(announced) >= warm["cached_tokens"] // 32, (len(announced), offloaded[:3])
        assert all(e.medium == "CPU" and e.locality == "LOCAL" for e in offloaded)


def test_serve_command_rejects_a_misspelled_key_before_any_start() -> None:
    with pytest.raises(ConfigError, match="did you mean 'cpu_bytes_per_node'"):
        serve_command("model", {"cpu_byte_per_node": "1GiB"}, port=8000)
