"""Stable import path for vLLM: ``"kv_connector_module_path": "tierstore.connector"``."""

from tierstore.vllm.connector import TierStoreConnector

__all__ = ["TierStoreConnector"]
