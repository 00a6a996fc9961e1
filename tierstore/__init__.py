"""tierstore: a Ray-distributed tiered KV-cache store for vLLM."""

__version__ = "0.1.0"
