"""Eviction policies, chosen by name through :data:`POLICIES`."""

from tierstore.control.policies.base import EvictionPolicy
from tierstore.registry import Registry

POLICIES: Registry[EvictionPolicy] = Registry("eviction policy", EvictionPolicy)  # type: ignore[type-abstract]

# Built-ins, registered last so the registry exists first.
POLICIES.register("lru", "tierstore.control.policies.lru", "LRUPolicy")
POLICIES.register("arc", "tierstore.control.policies.arc", "ARCPolicy")
