"""Token-id workloads for the end-to-end benchmark, in the shapes of ``vllm bench serve``.

- prefix repetition (its ``prefix_repetition`` dataset): ``num_prefixes`` shared
  prefixes, each sent ``repeats`` times with its own random suffix, in shuffled order.
- multi-turn chat: each turn's prompt is the previous turn's prompt, the model's answer
  and a new user message; conversations take turns (round robin), as concurrent users do.
- unique prompts: nothing to reuse (the 0 %-hit overhead).
- prefix hit: pairs of prompts sharing a prefix, the device prefix cache emptied between
  the two (``forget``), so the second one's prefix comes from the offloading connector,
  or is recomputed without one: the hit TTFT against the reference and against recompute.

Each workload's ``run(generate)`` sends its prompts, one at a time, through
``generate`` (prompt -> answer tokens) and returns them. Prompts are random token ids
(the tiny models have no tokenizer), seeded: the same arguments give the same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from tierstore.deploy.passes import random_prompt

Generate = Callable[[list[int]], list[int]]


@dataclass(frozen=True)
class PrefixRepetition:
    num_prefixes: int
    prefix_len: int
    suffix_len: int
    repeats: int
    seed: int = 1

    def prompts(self) -> list[list[int]]:
        prefixes = [
            random_prompt(self.prefix_len, seed=self.seed * 100_003 + p)
            for p in range(self.num_prefixes)
        ]
        prompts = [
            prefixes[p] + random_prompt(self.suffix_len, seed=self.seed * 7_919 + 1000 * p + r)
            for p in range(self.num_prefixes)
            for r in range(self.repeats)
        ]
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


def _send(prompts: list[list[int]], generate: Generate) -> list[list[int]]:
    for prompt in prompts:
        generate(prompt)
    return prompts


Workload = PrefixRepetition | MultiTurn | Unique | PrefixHit
WORKLOADS: dict[str, type[Workload]] = {
    "prefix_repetition": PrefixRepetition,
    "multi_turn": MultiTurn,
    "unique": Unique,
    "prefix_hit": PrefixHit,
}


def build(kind: str, params: dict[str, int]) -> Workload:
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[kind](**params)
