"""Token-id workloads for the end-to-end benchmark, in the shapes of ``vllm bench serve``.

- prefix repetition (its ``prefix_repetition`` dataset): ``num_prefixes`` shared
  prefixes, each sent ``repeats`` times with its own random suffix, in shuffled order.
  It is also vLLM's long-document QA (``benchmark_long_document_qa_throughput.py``):
  documents as the prefixes, a short question as each suffix, and that script's repeat
  modes as ``order``: ``random`` (shuffled), ``interleave`` (each document's queries back
  to back) or ``tile`` (every document once, then again).
- multi-turn chat: each turn's prompt is the previous turn's prompt, the model's answer
  and a new user message; conversations take turns (round robin), as concurrent users do.
- unique prompts: nothing to reuse (the 0 %-hit overhead).
- prefix hit: pairs of prompts sharing a prefix, the device prefix cache emptied between
  the two (``forget``), so the second one's prefix comes from the offloading connector,
  or is recomputed without one: the hit TTFT against the reference and against recompute.
- multi-round chat, in the shape of LMCache's ``multi-round-qa`` benchmark: ``users``
  users share one system prompt, each follows it with context of its own, then asks
  ``rounds`` questions, each answer appended to its history; requests arrive at ``qps``
  in all (paced, several in the engine at once), a user's next question only once its
  last answer is in.

Each workload but the chat's ``run(generate)`` sends its prompts, one at a time, through
``generate`` (prompt -> answer tokens) and returns them; the chat hands out its requests
as their times come (``MultiRound.session``). Prompts are random token ids (the tiny
models have no tokenizer), seeded: the same arguments give the same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tierstore.deploy.passes import random_prompt

Generate = Callable[[list[int]], list[int]]


ORDERS = ("random", "interleave", "tile")


@dataclass(frozen=True)
class PrefixRepetition:
    num_prefixes: int
    prefix_len: int
    suffix_len: int
    repeats: int
    seed: int = 1
    order: str = "random"  # vLLM's repeat modes: random, interleave, tile

    def prompts(self) -> list[list[int]]:
        if self.order not in ORDERS:
            raise ValueError(f"unknown order {self.order!r}; choose from {', '.join(ORDERS)}")
        prefixes = [
            random_prompt(self.prefix_len, seed=self.seed * 100_003 + p)
            for p in range(self.num_prefixes)
        ]
        grid = [
            [
                prefixes[p] + random_prompt(self.suffix_len, seed=self.seed * 7_919 + 1000 * p + r)
                for r in range(self.repeats)
            ]
            for p in range(self.num_prefixes)
        ]
        if self.order == "tile":
            return [grid[p][r] for r in range(self.repeats) for p in range(self.num_prefixes)]
        prompts = [prompt for queries in grid for prompt in queries]  # interleave
        if self.order == "random":
            random.Random(self.seed).shuffle(prompts)
        return prompts

    def run(self, generate: Generate) -> list[list[int]]:
        return _send(self.prompts(), generate)


@dataclass(frozen=True)
class MultiTurn:
    conversations: int
    turns: int
    system_len: int  # first message of each conversation (its own system prompt)
    user_len: int  # each turn's new user message
    seed: int = 2

    def run(self, generate: Generate) -> list[list[int]]:
        history = [
            random_prompt(self.system_len, seed=self.seed * 100_003 + c)
            for c in range(self.conversations)
        ]
        sent = []
        for turn in range(self.turns):
            for c in range(self.conversations):
                user = random_prompt(self.user_len, seed=self.seed * 7_919 + 1000 * c + turn)
                prompt = history[c] + user
                sent.append(prompt)
                history[c] = prompt + generate(prompt)
        return sent


@dataclass(frozen=True)
class Unique:
    count: int
    length: int
    seed: int = 3

    def prompts(self) -> list[list[int]]:
        return [random_prompt(self.length, seed=self.seed * 100_003 + i) for i in range(self.count)]

    def run(self, generate: Generate) -> list[list[int]]:
        return _send(self.prompts(), generate)


@dataclass(frozen=True)
class PrefixHit:
    pairs: int
    prefix_len: int
    suffix_len: int
    seed: int = 4

    def run(self, generate: Generate, forget: Callable[[], None] = lambda: None) -> list[list[int]]:
        """Per pair: the miss (stores the prefix), ``forget`` (empties the device prefix
        cache once the stores are done), then the hit. Even prompts are misses, odd hits."""
        sent = []
        for p in range(self.pairs):
            prefix = random_prompt(self.prefix_len, seed=self.seed * 100_003 + p)
            for r in range(2):
                if r == 1:
                    forget()
                suffix = random_prompt(self.suffix_len, seed=self.seed * 7_919 + 1000 * p + r)
                sent.append(prefix + suffix)
                generate(sent[-1])
        return sent


@dataclass(frozen=True)
class ChatRequest:
    index: int  # in the order the requests were scheduled: user + users * round
    user: int
    round: int
    prompt: list[int]
    scheduled_s: float  # when it was due, from the session's start (QPS pacing)


@dataclass(frozen=True)
class MultiRound:
    users: int
    rounds: int
    system_len: int  # the system prompt every user shares
    user_info_len: int  # each user's own context, after the system prompt
    question_len: int  # each round's new question
    qps: float  # requests per second, all users together
    seed: int = 5

    def schedule_s(self, user: int, round_: int) -> float:
        """When a question is due: users start ``1/qps`` apart and each asks every
        ``users/qps`` seconds, so requests arrive at ``qps`` in all (a user whose last
        answer is late asks once it is in)."""
        return (user + self.users * round_) / self.qps

    def first_prompt(self, user: int) -> list[int]:
        """The shared system prompt and the user's own context."""
        system = random_prompt(self.system_len, seed=self.seed * 100_003)
        return system + random_prompt(self.user_info_len, seed=self.seed * 100_003 + 1 + user)

    def question(self, user: int, round_: int) -> list[int]:
        return random_prompt(self.question_len, seed=self.seed * 7_919 + 1000 * user + round_)

    def session(self) -> ChatSession:
        return ChatSession(self)


@dataclass
class ChatSession:
    """One run of a ``MultiRound`` workload: which requests are due, and each user's
    history. Not thread-safe: one driver loop calls ``due``, ``answered`` and ``next_s``."""

    workload: MultiRound
    history: list[list[int]] = field(init=False)
    next_round: list[int] = field(init=False)
    waiting: set[int] = field(init=False, default_factory=set)
    sent: list[ChatRequest] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        w = self.workload
        self.history = [w.first_prompt(u) for u in range(w.users)]
        self.next_round = [0] * w.users

    def _ready(self) -> list[int]:
        w = self.workload
        return [
            u for u in range(w.users) if u not in self.waiting and self.next_round[u] < w.rounds
        ]

    def due(self, now_s: float) -> list[ChatRequest]:
        """The requests whose time has come by ``now_s`` (seconds since the start), in
        the order they were due; each user then waits for its answer (``answered``)."""
        w = self.workload
        ready = [u for u in self._ready() if w.schedule_s(u, self.next_round[u]) <= now_s]
        out = []
        for u in sorted(ready, key=lambda u: w.schedule_s(u, self.next_round[u])):
            r = self.next_round[u]
            prompt = self.history[u] + w.question(u, r)
            out.append(ChatRequest(u + w.users * r, u, r, prompt, w.schedule_s(u, r)))
            self.next_round[u] += 1
            self.waiting.add(u)
        self.sent += out
        return out

    def answered(self, request: ChatRequest, answer: list[int]) -> None:
        """The answer joins the user's history; its next question may go."""
        self.history[request.user] = request.prompt + answer
        self.waiting.discard(request.user)

    def next_s(self) -> float | None:
        """When the next request is due (None: every user waits for an answer, or is done)."""
        w = self.workload
        times = [w.schedule_s(u, self.next_round[u]) for u in self._ready()]
        return min(times) if times else None

    @property
    def done(self) -> bool:
        return not self.waiting and not self._ready()


def _send(prompts: list[list[int]], generate: Generate) -> list[list[int]]:
    for prompt in prompts:
        generate(prompt)
    return prompts


Workload = PrefixRepetition | MultiTurn | Unique | PrefixHit | MultiRound
WORKLOADS: dict[str, type[Workload]] = {
    "prefix_repetition": PrefixRepetition,
    "multi_turn": MultiTurn,
    "unique": Unique,
    "prefix_hit": PrefixHit,
    "multi_round": MultiRound,
}


def build(kind: str, params: dict[str, Any]) -> Workload:
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[kind](**params)
