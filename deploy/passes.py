"""Run prompt passes through one vLLM engine and record what tierstore is judged on.

Shared by the demo and the end-to-end tests: each pass sends token-id prompts (the tiny
models have no tokenizer), greedy, with log-probs, and records the tokens, the sampled
token's log-prob, ``num_cached_tokens`` and the time to the first token. Between passes
the engine's device prefix cache can be reset, so the next pass must come from
tierstore (or be recomputed).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

logger = logging.getLogger(__name__)

TIERSTORE_SPEC = {"spec_name": "TierStoreSpec", "spec_module_path": "tierstore.spec"}
# The in-process reference restore (tests and benchmarks compare tierstore against it).
REFERENCE_SPEC = {"spec_name": "ReferenceSpec", "spec_module_path": "tierstore.vllm.reference_spec"}


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that loads an offloading spec through tierstore's
    connector (vLLM's ``OffloadingConnector`` plus a failure path: a failed load
    recomputes its request instead of stopping the engine)."""
    return {
        "kv_connector": "TierStoreConnector",
        "kv_connector_module_path": "tierstore.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@dataclass
class RequestResult:
    tokens: list[int]
    logprobs: list[float]
    num_cached_tokens: int
    ttft_s: float
    latency_s: float = 0.0  # wall time of generate(): submitted to last token
    # Queued to first scheduled for compute: the TTFT's share spent on lookups and loads.
    wait_s: float = 0.0


@dataclass
class PassResult:
    requests: list[RequestResult] = field(default_factory=list)


@dataclass
class EngineSpec:
    model: str
    dtype: str = "float32"
    block_size: int | None = 32
    max_model_len: int = 4096
    kv_extra_config: dict[str, Any] | None = None  # None = no connector at all
    cpu_offload_gb: float = 0.0
    enforce_eager: bool = True
    seed: int = 0
    max_num_batched_tokens: int | None = None  # default: max_model_len
    tensor_parallel_size: int = 1  # the CPU build runs TP with its multiprocessing executor
    # Device KV cache size in blocks (None: what VLLM_CPU_KVCACHE_SPACE allows). A small
    # one makes the device prefix cache forget, as a busy server's does.
    num_gpu_blocks_override: int | None = None


def random_prompt(n_tokens: int, seed: int, vocab: int = 500) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, vocab) for _ in range(n_tokens)]


def build_llm(spec: EngineSpec) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec.model,
        "skip_tokenizer_init": True,
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        "enable_prefix_caching": True,
        "enforce_eager": spec.enforce_eager,
        "seed": spec.seed,
        "max_num_batched_tokens": spec.max_num_batched_tokens or spec.max_model_len,
        "disable_log_stats": False,  # keeps per-request timestamps for the TTFT
    }
    if spec.block_size is not None:
        kwargs["block_size"] = spec.block_size
    if spec.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = spec.tensor_parallel_size
    if spec.cpu_offload_gb:
        kwargs["cpu_offload_gb"] = spec.cpu_offload_gb
    if spec.num_gpu_blocks_override is not None:
        kwargs["num_gpu_blocks_override"] = spec.num_gpu_blocks_override
    if spec.kv_extra_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(spec.kv_extra_config)
    return LLM(**kwargs)


def run_pass(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int,
    reset_each: bool = False,
    progress: str | None = None,
    progress_file: TextIO | None = None,
) -> PassResult:
    """One request at a time, in order, so each sees what the earlier ones stored.

    With ``reset_each`` the device prefix cache is emptied before every request, so every
    cached token it reports came from the offloading connector. ``progress``: a label
    for a progress bar, drawn on ``progress_file`` (default stderr) if it is a terminal.
    """
    from tqdm import tqdm

    params = sampling_params(max_tokens)
    result = PassResult()
    bar_file = progress_file or sys.stderr
    shown = progress is not None and bar_file.isatty()
    bars = tqdm(prompts, desc=progress, unit="request", disable=not shown, file=bar_file)
    for prompt in bars:
        if reset_each:
            drain(llm)
            llm.reset_prefix_cache()
        result.requests.append(run_request(llm, prompt, params))
    return result


def sampling_params(max_tokens: int) -> Any:
    """Greedy, with the sampled token's log-prob, no detokenizing (no tokenizer)."""
    from vllm import SamplingParams

    # ignore_eos: a tiny random model samples its EOS id (from generation_config.json) now
    # and then; every request then decodes max_tokens, so stores flush and tests compare
    # the same number of tokens.
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True
    )


def run_request(llm: Any, prompt: list[int], params: Any) -> RequestResult:
    """One request, alone in the engine; its TTFT from the engine's own timestamps."""
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    return request_result(out, time.perf_counter() - started)


def request_result(out: Any, wall: float) -> RequestResult:
    """A finished ``RequestOutput`` as a ``RequestResult``: its TTFT and wait from the
    engine's own timestamps (``wall``, the caller's submit to finish, where they lack)."""
    stats = out.metrics
    # Queued (lookups and loads included) to first token.
    ttft = (
        stats.first_token_ts - stats.queued_ts
        if stats is not None and stats.first_token_ts and stats.queued_ts
        else wall
    )
    wait = (
        stats.scheduled_ts - stats.queued_ts
        if stats is not None and stats.scheduled_ts and stats.queued_ts
        else 0.0
    )
    completion = out.outputs[0]
    pairs = zip(completion.token_ids, completion.logprobs, strict=True)
    logprobs = [entry[token].logprob for token, entry in pairs]
    cached = out.num_cached_tokens or 0
    return RequestResult(list(completion.token_ids), logprobs, cached, ttft, wall, wait)


def warm_up(llm: Any) -> None:
    """One request on an unrelated prompt, so the first measured TTFT is not start-up."""
    run_request(llm, random_prompt(64, seed=99), sampling_params(1))


def drain(llm: Any, timeout_s: float = 120.0) -> None:
    """Return once the engine has no connector work left: every store job of the requests
    run so far is submitted, and acknowledged by its NodeStore (so the Evictor indexes it).

    ``generate`` returns when the last token is out, but vLLM builds a finished request's
    last store jobs on the next step and submits them on the one after. A multiprocess
    engine core keeps stepping while its connector has jobs (``has_pending_push_work``):
    pausing it in "wait" mode returns when that is over. An in-process engine core steps
    only when called, so this steps it until its scheduler has nothing left.
    """
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)  # InprocClient: the EngineCore itself
    if core is None:
        client.call_utility("pause_scheduler", "wait", False)  # blocks until drained
        client.call_utility("resume_scheduler")
        return
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine still has connector work after {timeout_s} s")
        llm.llm_engine.step()
        time.sleep(0.005)  # mostly waiting on transfer threads: leave them the cores


def shutdown_engine(llm: Any, timeout_s: float = 60.0) -> None:
    """Stop the engine's processes now, in order, instead of at interpreter exit.

    vLLM stops an engine core process with SIGTERM. Where tierstore's connector has
    joined Ray, Ray's failure-signal handler in that process answers SIGTERM with a
    ``*** SIGTERM received ***`` stack dump before vLLM's own handler shuts the engine
    down cleanly: an orderly stop that reads as a crash. The engine core answers SIGINT
    with the same clean shutdown, and Ray's handler does not watch SIGINT; so each engine
    core process gets SIGINT and is waited for (its workers stop with it), and vLLM's
    shutdown then finds nothing left to terminate (it still terminates what did not exit
    within ``timeout_s``; its client logs that the engine core "exited unexpectedly": it
    did not stop it itself). Blocks until the processes are gone.
    """
    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes = [p for p in getattr(manager, "processes", []) if p.is_alive()]
    logger.info("stopping the engine core (%d process(es)) with SIGINT", len(processes))
    for proc in processes:
        os.kill(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    client.shutdown()
