"""The end-to-end benchmark's engine sizes and workloads, per model and run length.

Each model's tiers are sized from its KV bytes per token, so both see the same shares of
CPU and disk hits: the tiny Llama has 1 KiB per token (a 32-token chunk is 32 KiB), the
0.1 B one 4 KiB (128 KiB chunks). The 0.1 B model computes ~60x more per token on a CPU
core, so its workloads are shorter.
"""

from __future__ import annotations

from typing import Any

# --model choice -> the model's name in deploy/models.py
MODELS = {"tiny": "llama", "0.1b": "llama-0.1b"}

_TINY_FULL: dict[str, Any] = {
    "device_blocks": 72,  # 2304 tokens (vLLM keeps one block back): about two prompts
    "max_model_len": 2048,
    "cpu_bytes": 4 << 20,  # 128 chunks: half the shared prefixes; the rest from disk
    "disk_bytes": 256 << 20,
    "max_tokens": 16,
    "workloads": {
        "unique": {"kind": "unique", "params": {"count": 24, "length": 1088}},
        "prefix_hit": {
            "kind": "prefix_hit",
            "params": {"pairs": 8, "prefix_len": 1024, "suffix_len": 64},
        },
        "prefix_repetition": {
            "kind": "prefix_repetition",
            "params": {"num_prefixes": 8, "prefix_len": 1024, "suffix_len": 64, "repeats": 5},
        },
        "multi_turn": {
            "kind": "multi_turn",
            "params": {"conversations": 8, "turns": 4, "system_len": 384, "user_len": 96},
        },
    },
}
_TINY_QUICK: dict[str, Any] = {
    **_TINY_FULL,
    "device_blocks": 25,  # 800 tokens (vLLM keeps one block back): one or two prompts
    "max_model_len": 768,
    "cpu_bytes": 1 << 20,  # 32 chunks: more than one request stores, less than all
    "max_tokens": 4,
    "workloads": {
        "unique": {"kind": "unique", "params": {"count": 2, "length": 256}},
        "prefix_hit": {
            "kind": "prefix_hit",
            "params": {"pairs": 1, "prefix_len": 512, "suffix_len": 32},
        },
        "prefix_repetition": {
            "kind": "prefix_repetition",
            "params": {"num_prefixes": 2, "prefix_len": 512, "suffix_len": 32, "repeats": 2},
        },
        "multi_turn": {
            "kind": "multi_turn",
            "params": {"conversations": 2, "turns": 2, "system_len": 256, "user_len": 64},
        },
    },
}
_SMALL_FULL: dict[str, Any] = {
    "device_blocks": 72,
    "max_model_len": 2048,
    "cpu_bytes": 8 << 20,  # 64 chunks of 128 KiB: two of the three shared prefixes
    "disk_bytes": 1 << 30,
    "max_tokens": 8,
    "workloads": {
        "unique": {"kind": "unique", "params": {"count": 6, "length": 1088}},
        "prefix_hit": {
            "kind": "prefix_hit",
            "params": {"pairs": 4, "prefix_len": 1024, "suffix_len": 64},
        },
        "prefix_repetition": {
            "kind": "prefix_repetition",
            "params": {"num_prefixes": 3, "prefix_len": 1024, "suffix_len": 64, "repeats": 3},
        },
    },
}
_SMALL_QUICK: dict[str, Any] = {
    **_SMALL_FULL,
    "device_blocks": 25,
    "max_model_len": 768,
    "cpu_bytes": 4 << 20,
    "max_tokens": 2,
    "workloads": {
        "unique": {"kind": "unique", "params": {"count": 1, "length": 256}},
        "prefix_hit": {
            "kind": "prefix_hit",
            "params": {"pairs": 1, "prefix_len": 256, "suffix_len": 32},
        },
    },
}
SETUPS: dict[tuple[str, bool], dict[str, Any]] = {
    ("tiny", False): _TINY_FULL,
    ("tiny", True): _TINY_QUICK,
    ("0.1b", False): _SMALL_FULL,
    ("0.1b", True): _SMALL_QUICK,
}


def setup_for(model: str, quick: bool) -> dict[str, Any]:
    if model not in MODELS:
        raise ValueError(f"unknown e2e model {model!r}; choose from {', '.join(MODELS)}")
    return SETUPS[(model, quick)]
