"""The vLLM adapter: an out-of-tree OffloadingSpec with its manager and worker."""
