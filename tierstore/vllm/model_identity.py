"""What a namespace knows of the engine beyond the byte shape: which model computed the KV.

vLLM's ``OffloadingConfig`` names the model by its path and says nothing of its revision,
quantization, ``hf_overrides`` or weights, so two engines on one path would read each
other's KV (wrong output, checksums passing). :func:`engine_identity` adds, from the
engine's ``VllmConfig``:

- ``model``: vLLM's own ``ModelConfig.compute_hash()`` (revision, quantization, dtype, the
  HF config after ``hf_overrides``, the model path, ...), with ``max_model_len`` held at 0:
  it never changes a K/V value, and an engine whose length vLLM fits to memory would
  otherwise leave every other length's chunks;
- ``cache``: the cache settings that change what a page's bytes mean beyond its size;
- ``weights``: :func:`weights_fingerprint`, a cheap digest of the weight files' contents,
  which catches weights replaced in place under the same path and config;
- the same two for a speculative-decoding draft model, whose layers are offloaded too.

How the spec reaches the ``VllmConfig``: vLLM builds the spec inside
``OffloadingConnector.__init__`` from an ``OffloadingConfig`` only. ``TierStoreConnector``
wraps that call in :func:`building_for` (the scheduler's connector and every worker's);
elsewhere :func:`current_engine_config` falls back to vLLM's current config, set only in
some worker code paths.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_ENGINE: ContextVar[Any] = ContextVar("tierstore_engine_config", default=None)

# Files whose bytes are model weights (top level of the model folder), and the code of a
# trust_remote_code model (hashed whole up to HEAD_BYTES, like any small file).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz")
CODE_SUFFIXES = (".py",)
WINDOW_BYTES = 64  # one sample
GRID_WINDOWS = 64  # evenly spaced samples over every weight file
MAX_TENSOR_WINDOWS = 4096  # per safetensors file: the start of (at most) this many tensors
HEAD_BYTES = 64 << 10  # read whole: a file this small, and a non-safetensors file's head
_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit
# Cache settings that change what a page's bytes mean where its size may stay the same.
_CACHE_FIELDS = (
    "cache_dtype",
    "kv_cache_dtype_skip_layers",
    "calculate_kv_scales",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
    "mamba_cache_mode",
    "prefix_caching_hash_algo",  # block hashes of different algorithms never meet anyway
)


@contextlib.contextmanager
def building_for(vllm_config: Any) -> Iterator[None]:
    """The engine config that the specs built inside see (``TierStoreConnector`` wraps
    ``OffloadingConnector.__init__``, which builds the spec, in this)."""
    token = _ENGINE.set(vllm_config)
    try:
        yield
    finally:
        _ENGINE.reset(token)


def current_engine_config() -> Any | None:
    """The ``VllmConfig`` of the engine whose spec is being built, or None if unknown."""
    found = _ENGINE.get()
    if found is not None:
        return found
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - both supported vLLMs have it
        return None
    return get_current_vllm_config_or_none()


@dataclass(frozen=True)
class WeightsFingerprint:
    digest: str  # hex
    covers: str  # what the digest covers, for the log


def engine_identity(vllm_config: Any, pinned: str | None = None) -> dict[str, object]:
    """Everything of ``vllm_config`` that changes K/V values beyond the page shape (which
    ``OffloadingConfig`` already gives). Start-up only: it samples the weight files.

    ``pinned`` (the ``model_identity`` key) stands in for the model's hash, name and
    weights: the user's promise that engines under one pin compute the same K/V."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    cache_identity = {name: _plain(getattr(cache, name, None)) for name in _CACHE_FIELDS}
    if pinned is not None:
        logger.info("tierstore namespace: model pinned as %r (model_identity)", pinned)
        return {"pinned": pinned, "cache": cache_identity}
    weights = weights_fingerprint(model, _download_dir(vllm_config))
    logger.info("tierstore namespace: model weights fingerprint covers %s", weights.covers)
    identity: dict[str, object] = {
        "model": model_hash(model),
        "weights": weights.digest,
        "cache": cache_identity,
    }
    draft = getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config", None)
    if draft is not None and draft is not model:
        draft_weights = weights_fingerprint(draft, _download_dir(vllm_config))
        logger.info(
            "tierstore namespace: draft weights fingerprint covers %s", draft_weights.covers
        )
        identity["draft_model"] = model_hash(draft)
        identity["draft_weights"] = draft_weights.digest
    return identity


def model_hash(model_config: Any) -> str:
    """vLLM's ``ModelConfig.compute_hash()``, ``max_model_len`` held at 0 (a copy is
    hashed: the engine's own config is left alone)."""
    neutral = copy.copy(model_config)
    object.__setattr__(neutral, "max_model_len", 0)
    return str(neutral.compute_hash())


def _plain(value: object) -> object:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _download_dir(vllm_config: Any) -> str | None:
    return getattr(getattr(vllm_config, "load_config", None), "download_dir", None)


def weights_fingerprint(model_config: Any, download_dir: str | None = None) -> WeightsFingerprint:
    """A digest of the model's weight files, read in samples (never whole).

    A local folder or file is sampled as it is; a Hugging Face name is looked up in the
    local HF cache (or vLLM's ``download_dir``) at its revision. Where no weights are
    found (an object store, a name never downloaded here), the digest covers the name
    and revision only. Paths and modification times stay out: two nodes holding the same
    bytes at different places, or downloaded at different times, share chunks.
    """
    name = str(model_config.model)
    revision = getattr(model_config, "revision", None)
    files, where = _weight_files(name, revision, download_dir)
    if not files:
        digest = _sha256_json(["name-only", name, revision])
        return WeightsFingerprint(
            digest,
            f"the name {name!r} and revision {revision!r} only (no local weight files found)",
        )
    h = hashlib.sha256()
    total = 0
    unreadable = []
    for rel, path in files:
        try:
            size = path.stat().st_size
            sampled = _file_digest(path, size)
        except OSError:  # e.g. a stray file of another user's: its name is still covered
            unreadable.append(rel)
            h.update(json.dumps([rel, "unreadable"]).encode())
            continue
        total += size
        h.update(json.dumps([rel, size]).encode())
        h.update(sampled)
    covers = (
        f"{len(files)} file(s), {total} bytes, in {where}: names, sizes, safetensors headers "
        f"and {WINDOW_BYTES}-byte samples (each tensor's start, {GRID_WINDOWS} per file)"
    )
    if unreadable:
        covers += f"; only the names of the unreadable {', '.join(unreadable)}"
    return WeightsFingerprint(h.hexdigest(), covers)


def _sha256_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _weight_files(
    name: str, revision: str | None, download_dir: str | None
) -> tuple[list[tuple[str, Path]], str]:
    """``(relative name, path)`` of every weight and code file, sorted, and where."""
    root = Path(name).expanduser()
    if root.is_file():
        return [(root.name, root)], str(root)
    if not root.is_dir():
        snapshot = _hf_snapshot(name, revision, download_dir)
        if snapshot is None:
            return [], name
        root = snapshot
    suffixes = WEIGHT_SUFFIXES + CODE_SUFFIXES
    files = sorted((p.name, p) for p in root.iterdir() if p.name.endswith(suffixes) and p.is_file())
    if not any(rel.endswith(WEIGHT_SUFFIXES) for rel, _ in files):
        return [], str(root)
    return files, str(root)


def _hf_snapshot(name: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The local snapshot folder of a Hugging Face model at ``revision``, if cached."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - vLLM depends on it
        return None
    for cache_dir in dict.fromkeys([download_dir, None]):
        try:
            found = try_to_load_from_cache(
                name, "config.json", cache_dir=cache_dir, revision=revision
            )
        except Exception:  # a name that is no repo id: nothing cached under it
            logger.debug("no HF cache entry for %r", name, exc_info=True)
            continue
        if isinstance(found, str):
            return Path(found).parent
    return None


def _file_digest(path: Path, size: int) -> bytes:
    """Sampled digest of one file: a small file whole; a safetensors file's header, the
    start of each tensor and a grid; another file's head and a grid."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        if size <= HEAD_BYTES:
            h.update(os.pread(fd, size, 0))
            return h.digest()
        data_start = 0
        tensor_starts: list[int] = []
        if path.name.endswith(".safetensors"):
            data_start, tensor_starts = _safetensors_layout(fd, size, h)
        if data_start == 0:
            h.update(os.pread(fd, HEAD_BYTES, 0))
        for offset in [*tensor_starts, *_grid(data_start, size)]:
            h.update(os.pread(fd, WINDOW_BYTES, offset))
    finally:
        os.close(fd)
    return h.digest()


def _safetensors_layout(fd: int, size: int, h: Any) -> tuple[int, list[int]]:
    """Hash the header; returns where the data starts and the tensors' start offsets
    (``(0, [])`` where the file is not a well-formed safetensors file)."""
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if not 2 <= length <= min(_MAX_HEADER_BYTES, size - 8):
        return 0, []
    header = os.pread(fd, length, 8)
    try:
        tensors = json.loads(header)
        spans = sorted(tuple(v["data_offsets"]) for k, v in tensors.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError):
        return 0, []
    h.update(header)
    data_start = 8 + length
    starts = [data_start + int(b) for b, e in spans if int(e) > int(b)]
    if len(starts) > MAX_TENSOR_WINDOWS:
        step = len(starts) / MAX_TENSOR_WINDOWS
        starts = [starts[int(i * step)] for i in range(MAX_TENSOR_WINDOWS)]
    return data_start, starts


def _grid(start: int, end: int) -> list[int]:
    """``GRID_WINDOWS`` window offsets spread evenly over ``[start, end)``."""
    span = end - start - WINDOW_BYTES
    if span <= 0:
        return [start]
    return [start + span * i // (GRID_WINDOWS - 1) for i in range(GRID_WINDOWS)]
