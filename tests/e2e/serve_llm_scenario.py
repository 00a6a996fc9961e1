"""Ray Serve LLM with tierstore on two simulated nodes; writes JSON facts.

Run by ``test_serve_llm.py`` as ``python -m tests.e2e.serve_llm_scenario MODEL OUT_JSON``
in its own process: it is the driver of its own ``ray.cluster_utils.Cluster`` (the test
session may already be a driver of another cluster, and a process joins only one).

The app (``tierstore.deploy.serve_llm``) serves the tiny llama with tierstore on two
replicas. Each asks for two CPUs (Ray Serve LLM's CPU bundle plus the replica actor's),
and each of the two raylets has two, so Ray places one replica per raylet (the head has
one, for the ingress).

1. PROMPT goes to the app: some replica, A, computes it and tierstore stores its chunks
   on A's node (the engine's processes, started by vLLM outside Ray, attach their Ray
   connection to the head's raylet; tierstore works for the replica's node).
2. PROMPT again, until a replica answers it from tierstore: that is not A (A's own device
   prefix cache holds it, and a device hit loads nothing), so it is B, which loads the
   chunks from A's node. Serve's router picks between two idle replicas at random, so
   this takes two tries on average.

PROMPT is the e2e suite's (tests/e2e/conftest.py): the test compares the tokens with the
suite's run of the same model without tierstore.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.cluster_utils import Cluster
from tierstore.deploy.cli import collect_status
from tierstore.deploy.serve_llm import llm_config, openai_app, replica_nodes

from tests.e2e.conftest import PROMPT
from tests.support import E2E_LOOKUP_TIMEOUT_MS, LOOPBACK, free_port, poll

NAMESPACE = "tierstore-serve-llm"
BLOCK = 32
MODEL_ID = "tiny"
MAX_TRIES = 12  # to reach the other replica: each try does with probability 1/2
_STORED_TIMEOUT_S = 60.0
_HIT_COUNT_TIMEOUT_S = 10.0
_REQUEST_TIMEOUT_S = 300.0
# One engine per replica, the CPU build's: its KV cache in GiB, a small one (two run).
_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
_ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": BLOCK,
    "max_model_len": 4096,
    "max_num_batched_tokens": 4096,  # as the suite's reference engine (EngineSpec)
    "enforce_eager": True,
    "skip_tokenizer_init": True,  # the tiny models have no tokenizer: prompts are token ids
    "enable_prompt_tokens_details": True,  # usage.prompt_tokens_details.cached_tokens
}
# On the CUDA build (not run here yet): each raylet gets one GPU, which cluster_utils maps
# to the same device, so the two engines share it, a third of its memory each.
_GPU_ENGINE_KWARGS = {"gpu_memory_utilization": 0.3}


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _app(model: str, gcs_address: str) -> Any:
    tierstore = {
        "cpu_bytes_per_node": 1 << 30,
        "namespace": NAMESPACE,
        "ray_address": gcs_address,
        "lookup_timeout_ms": E2E_LOOKUP_TIMEOUT_MS,
    }
    runtime_env = {"env_vars": _ENGINE_ENV}
    with_tierstore = llm_config(
        model,
        tierstore,
        model_id=MODEL_ID,
        num_replicas=2,
        cpu=not _cuda(),
        engine_kwargs={**_ENGINE_KWARGS, **(_GPU_ENGINE_KWARGS if _cuda() else {})},
        runtime_env=runtime_env,
    )
    return openai_app([with_tierstore])


def _complete(client: Any, model: str = MODEL_ID) -> dict[str, Any]:
    """PROMPT, greedy, 8 tokens, token ids in and out, through the OpenAI client."""
    response = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        logprobs=0,
        extra_body={
            "ignore_eos": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,  # no tokenizer: log-probs name tokens by id
        },
    )
    choice = response.choices[0]
    details = response.usage.prompt_tokens_details
    return {
        "tokens": list(choice.token_ids),
        "logprobs": list(choice.logprobs.token_logprobs),
        "cached_tokens": None if details is None else details.cached_tokens,
    }


def _totals() -> dict[str, int]:
    return dict(collect_status(NAMESPACE)["totals"])


def _cpu_chunks_by_node() -> dict[str, int]:
    """Each NodeStore's chunks in its CPU tier, by node."""
    return {n["node_id"]: n["cpu"]["chunks"] for n in collect_status(NAMESPACE)["nodes"]}


def _tries_until(step: Callable[[int], bool]) -> int:
    for attempt in range(1, MAX_TRIES + 1):
        if step(attempt):
            return attempt
    raise AssertionError(f"no replica loaded PROMPT from tierstore in {MAX_TRIES} tries")


def main(model: str, out: Path) -> None:
    from openai import OpenAI

    facts: dict[str, Any] = {}

    def save() -> None:
        out.write_text(json.dumps(facts))

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "node_ip_address": LOOPBACK,
        },
    )
    gpus = 1 if _cuda() else 0
    nodes = [
        cluster.add_node(num_cpus=2, num_gpus=gpus, node_ip_address=LOOPBACK) for _ in range(2)
    ]
    started = time.monotonic()
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        facts["nodes"] = sorted(n.node_id for n in nodes)
        port = free_port()
        serve.start(http_options={"host": LOOPBACK, "port": port})
        serve.run(_app(model, cluster.address), name="llm", route_prefix="/")
        facts["ready_s"] = time.monotonic() - started
        facts["replica_nodes"] = replica_nodes()
        save()
        client = OpenAI(
            base_url=f"http://{LOOPBACK}:{port}/v1",
            api_key="unused",
            timeout=_REQUEST_TIMEOUT_S,
            max_retries=0,
        )
        facts["models"] = sorted(m.id for m in client.models.list().data)
        facts["cold"] = _complete(client, MODEL_ID)
        chunks = len(PROMPT) // BLOCK
        poll(
            lambda: _totals()["indexed_chunks"],
            _STORED_TIMEOUT_S,
            poll_s=0.5,
            done=lambda n: n >= chunks,
        )
        facts["before"] = _totals()
        facts["stored_by_node"] = _cpu_chunks_by_node()
        facts["device_hits"] = []

        def step(attempt: int) -> bool:
            before = _totals()
            warm = _complete(client, MODEL_ID)
            # The manager reports loads to the Evictor after they complete, one-way.
            after = poll(
                _totals,
                _HIT_COUNT_TIMEOUT_S if warm["cached_tokens"] else 0.5,
                poll_s=0.5,
                done=lambda t: t["loaded_chunks"] > before["loaded_chunks"],
            )
            if after["loaded_chunks"] > before["loaded_chunks"]:
                facts["warm"], facts["warm_before"], facts["warm_after"] = warm, before, after
                return True
            facts["device_hits"].append(warm)  # replica A again, from its device cache
            return False

        facts["tries"] = _tries_until(step)
        facts["scenario_s"] = time.monotonic() - started
        save()
    finally:
        save()
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    os.environ.update(_ENGINE_ENV)
    main(sys.argv[1], Path(sys.argv[2]))
