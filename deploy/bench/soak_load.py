"""The soak's client load: concurrent greedy completions over the OpenAI API, with the
``openai`` package, as a user's application sends them.

The workload mixes prefix repetition (conversations open with one of a few shared
prefixes) and multi-turn (each turn's prompt is the previous prompt, its output and new
tokens). Every response is kept with its prompt, so it can be compared with the response
of a server without tierstore to the same prompt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tierstore.deploy.bench.common import stream_completion
from tierstore.deploy.passes import random_prompt

logger = logging.getLogger(__name__)

_ATTEMPT_TIMEOUT_S = 120.0  # one HTTP attempt; a stalled stream is abandoned and retried
_RETRY_PAUSE_S = 1.0


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    prefixes: int = 4
    prefix_tokens: int = 512
    opening_tokens: int = 64  # after the shared prefix: each conversation's own
    turn_tokens: int = 32  # new tokens of each later turn
    max_tokens: int = 16

    def opening(self, conversation: int) -> list[int]:
        shared = random_prompt(self.prefix_tokens, seed=1000 + conversation % self.prefixes)
        return shared + random_prompt(self.opening_tokens, seed=2000 + conversation)

    def next_prompt(self, conversation: int, turn: int, prompt: list[int], out: list[int]):
        return prompt + out + random_prompt(self.turn_tokens, seed=3000 + 50 * conversation + turn)


@dataclass
class Response:
    conversation: int
    turn: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    ttft_s: float = 0.0  # of the attempt that succeeded
    wait_s: float = 0.0  # from the first attempt to the first token, retries included
    attempts: int = 0
    error: str | None = None  # set when no attempt succeeded before the deadline


def complete(client, model: str, prompt: list[int], max_tokens: int, resp: Response) -> None:
    """One streamed greedy completion with log-probs; fills ``resp`` (raises on any
    failure)."""
    got = stream_completion(
        client, model, prompt, max_tokens, logprobs=True, timeout_s=_ATTEMPT_TIMEOUT_S
    )
    resp.tokens, resp.logprobs = got.tokens, got.logprobs
    resp.cached_tokens, resp.ttft_s = got.cached_tokens, got.ttft_s


def send(client, model: str, prompt: list[int], resp: Response, wl: Workload, deadline_s: float):
    """Retries on any error (the server may be restarting) until ``deadline_s`` has passed:
    a request is failed only if it was never served."""
    started = time.monotonic()
    while True:
        resp.attempts += 1
        attempt_started = time.monotonic()
        try:
            complete(client, model, prompt, wl.max_tokens, resp)
            resp.wait_s = attempt_started - started + resp.ttft_s
            resp.error = None
            return
        except Exception as exc:  # connection refused, 5xx, a stream cut by a kill
            resp.error = f"{type(exc).__name__}: {exc}"[:300]
            if time.monotonic() - started > deadline_s:
                logger.error("request failed for good: %s", resp.error)
                return
            time.sleep(_RETRY_PAUSE_S)


def run_conversation(client, model: str, wl: Workload, c: int, deadline_s: float) -> list[Response]:
    """The turns of one conversation, in order (a turn's prompt needs the last output)."""
    out: list[Response] = []
    prompt = wl.opening(c)
    for turn in range(wl.turns):
        resp = Response(c, turn, prompt)
        send(client, model, prompt, resp, wl, deadline_s)
        out.append(resp)
        if resp.error is not None:
            break  # the next turn's prompt would need this output
        prompt = wl.next_prompt(c, turn + 1, prompt, resp.tokens)
    return out


def run_rounds(
    base_url: str,
    model: str,
    wl: Workload,
    concurrency: int,
    keep_going: Callable[[int], bool],
    deadline_s: float = 600.0,
) -> list[Response]:
    """Rounds of every conversation (``concurrency`` at a time) while ``keep_going(rounds
    done)``; at least one round."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="soak", max_retries=0)
    responses: list[Response] = []
    lock = threading.Lock()
    rounds = 0

    def one(c: int) -> None:
        got = run_conversation(client, model, wl, c, deadline_s)
        with lock:
            responses.extend(got)

    with ThreadPoolExecutor(concurrency, thread_name_prefix="soak-client") as pool:
        while rounds == 0 or keep_going(rounds):
            list(pool.map(one, range(wl.conversations)))
            rounds += 1
            logger.info("round %d done: %d responses", rounds, len(responses))
    return responses


def answers(responses: list[Response]) -> dict[tuple[int, ...], Response]:
    """Served responses by prompt (the reference run's: one per prompt)."""
    return {tuple(r.prompt): r for r in responses if r.error is None}


def replay(base_url: str, model: str, prompts: list[list[int]], wl: Workload) -> list[Response]:
    """Each prompt once, one at a time (the sweep: every stored chunk is looked up)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="soak", max_retries=0)
    out = []
    for prompt in prompts:
        resp = Response(-1, -1, prompt)
        send(client, model, prompt, resp, wl, deadline_s=120.0)
        out.append(resp)
    return out
