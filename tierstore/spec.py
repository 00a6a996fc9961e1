"""Stable import path for vLLM: ``"spec_module_path": "tierstore.spec"``."""

from tierstore.vllm.spec import TierStoreSpec

__all__ = ["TierStoreSpec"]
