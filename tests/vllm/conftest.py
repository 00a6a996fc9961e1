"""The vLLM-side tests use the actor tests' fixtures: one real local Ray cluster per
module, and a config whose actors are stopped after each test."""

from tests.actors.conftest import cfg, ray_local

__all__ = ["cfg", "ray_local"]  # pytest finds fixtures by name in this module
