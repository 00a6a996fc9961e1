"""Tiny models with random weights, made locally (no hub access): one per KV-cache family.

Each is small enough for the CPU build of vLLM to start in about a minute, yet keeps the
KV cache group structure of its family: that structure is what tierstore must restore.
Weights are seeded, so the same name always gives the same model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_VOCAB = 512
# Ten times transformers' default: at 0.02 a tiny random model's next-token distribution
# is nearly uniform and barely depends on the context, so a wrong KV restore would hardly
# show. At 0.1 flipping one early prompt token moves log-probs by ~0.5-1.5 (measured).
_INIT_RANGE = 0.1


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    # 4 sliding + 2 full layers: vLLM splits them into 3 KV cache groups of 2 layers.
    return Gemma3TextConfig(
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=128,
        max_position_embeddings=4096,
        layer_types=["sliding_attention"] * 2
        + ["full_attention"]
        + ["sliding_attention"] * 2
        + ["full_attention"],
    )


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"],
    )


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig

    # The CPU build's GDN kernel wants linear-attention head dims of 128.
    return Qwen3NextConfig(
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        max_position_embeddings=4096,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )


def _nemotron_h() -> Any:
    from transformers import NemotronHConfig

    # Mamba2, MLP, attention, MLP, Mamba2, MLP. On the CPU build a Mamba2 layer can only
    # run prefill pieces of at most one block (see ENGINE_LIMITS): with prefix caching
    # its "align" mode checkpoints inside longer pieces, which the CPU SSM op cannot
    # (vllm mamba_mixer2.py:880 indexes per-chunk states the CPU op does not return).
    return NemotronHConfig(  # type: ignore[call-arg]  # keys the config takes as kwargs
        vocab_size=_VOCAB,
        hidden_size=128,
        hybrid_override_pattern="M-*-M-",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=256,
        mlp_hidden_act="relu2",
        mamba_num_heads=4,
        mamba_head_dim=32,
        n_groups=1,
        ssm_state_size=16,
        conv_kernel=4,
        chunk_size=128,
        expand=1,
        use_conv_bias=True,
        mamba_proj_bias=False,
        use_bias=False,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def _gemma4() -> Any:
    from transformers import Gemma4TextConfig

    # Sliding layers of head dim 32, full layers of head dim 64 (``global_head_dim``), and
    # the per-layer input embeddings: 4 sliding + 2 full layers, 3 KV cache groups.
    return Gemma4TextConfig(  # type: ignore[call-arg]  # keys the config takes as kwargs
        vocab_size=_VOCAB,
        vocab_size_per_layer_input=_VOCAB,
        hidden_size_per_layer_input=16,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        sliding_window=128,
        max_position_embeddings=4096,
        layer_types=["sliding_attention"] * 2
        + ["full_attention"]
        + ["sliding_attention"] * 2
        + ["full_attention"],
    )


# Qwen3.6 (``Qwen3_5*``): 4 GDN + 2 full attention layers, 3 KV cache groups. The CPU
# build's GDN kernel wants linear-attention head dims of 128, and bf16.
_QWEN3_5_COMMON: dict[str, Any] = {
    "vocab_size": _VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 4096,
    "layer_types": ["linear_attention"] * 2
    + ["full_attention"]
    + ["linear_attention"] * 2
    + ["full_attention"],
}


def _qwen3_5() -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(intermediate_size=256, **_QWEN3_5_COMMON)


def _qwen3_5_moe() -> Any:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        **_QWEN3_5_COMMON,
    )


def _llama4() -> Any:
    from transformers import Llama4TextConfig

    # 3 chunked local-attention layers (RoPE, 128-token chunks) and 1 full NoPE layer,
    # 4 KV cache groups; every other layer MoE.
    return Llama4TextConfig(
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=64,
        intermediate_size_mlp=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=4,
        attention_chunk_size=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def _deepseek_v3() -> Any:
    from transformers import DeepseekV3Config

    # MLA: one latent KV cache group. A dense first layer, then MoE routed as transformers'
    # DeepSeek-V3 routes (sigmoid scores plus a bias): vLLM reads that from topk_method
    # and scoring_func, which transformers' config does not write; without them vLLM has
    # no parameter for the checkpoint's e_score_correction_bias (KeyError at load).
    # The latent KV row (kv_lora_rank + qk_rope_head_dim) must be a size vLLM's MLA
    # supports (MLACommonBackend: 320, 512, 576), and the CPU decode kernel
    # (mla_decode_kvcache_cpu) runs only 576 with its block size of 16.
    return DeepseekV3Config(  # type: ignore[call-arg]  # keys the config takes as kwargs
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


TINY_MODELS: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "gemma3": _gemma3,
    "gpt-oss": _gpt_oss,
    "qwen3-next": _qwen3_next,
    "nemotron-h": _nemotron_h,
    "gemma4": _gemma4,
    "qwen3.6": _qwen3_5,
    "qwen3.6-moe": _qwen3_5_moe,
    "llama4": _llama4,
    "deepseek-v3": _deepseek_v3,
}


def _llama_100m() -> Any:
    from transformers import LlamaConfig

    # Real-model proportions of KV bytes to compute, for the e2e benchmark: ~0.094 B
    # parameters and 4 KiB of KV per token in fp32 (2 x 8 layers x 2 KV heads x 32 dims
    # x 4 bytes), about Llama-3.2-1B's 32 KiB per token scaled to a tenth of its size.
    # fp32: this machine's CPU has no AVX-512, where the CPU build's bf16 is slow. GQA:
    # 32 query heads share 2 KV heads. The tiny ``llama`` (1 KiB per token for 1.6 M
    # parameters) is ~100x more KV-heavy and overstates every copy.
    return LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


# Larger random models for benchmarks (not KV-cache families: tests do not run them).
BENCH_MODELS: dict[str, Callable[[], Any]] = {"llama-0.1b": _llama_100m}
_MODELS = TINY_MODELS | BENCH_MODELS

# Engine settings a family needs on the CPU build, beyond the defaults.
ENGINE_LIMITS: dict[str, dict[str, Any]] = {
    "nemotron-h": {"max_num_batched_tokens": 32},  # = block size: one block per prefill piece
}


def make_tiny_model(name: str, root: Path, dtype: str = "float32", seed: int = 0) -> Path:
    """Write a random model (tiny, or a benchmark's) under ``root/name`` once; returns its
    directory."""
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(_MODELS)}")
    path = Path(root) / f"{name}-{dtype}"
    marker = path / "config.json"
    if marker.exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    _random_model(name, dtype, seed).save_pretrained(path, safe_serialization=True)
    # Written last: its presence means the model is complete.
    data = json.loads(marker.read_text())
    marker.write_text(json.dumps(data, indent=2))
    logger.info("made random %s model at %s", name, path)
    return path


def replace_weights(path: Path, name: str, dtype: str = "float32", seed: int = 1) -> None:
    """Replace the weights of the random model at ``path`` (made by ``make_tiny_model``)
    in place: same config, same file names and sizes, new random values from ``seed``,
    each file renamed over the old one, as a redeploy to the same path would."""
    import tempfile

    path = Path(path)
    with tempfile.TemporaryDirectory(dir=path.parent) as staging:
        _random_model(name, dtype, seed).save_pretrained(staging, safe_serialization=True)
        for fresh in Path(staging).glob("*.safetensors*"):
            fresh.replace(path / fresh.name)
    logger.info("replaced the weights of %s (seed %d)", path, seed)


def _random_model(name: str, dtype: str, seed: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _MODELS[name]()
    config.dtype = dtype
    config.initializer_range = _INIT_RANGE
    return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
