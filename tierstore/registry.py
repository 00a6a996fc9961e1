"""A lazy name -> class registry for pluggable parts (eviction policies, tiers)."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from tierstore.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a name to ``module:Class``, imported only when first asked for."""

    def __init__(self, kind: str, base: type[T]) -> None:
        self._kind = kind
        self._base = base
        self._entries: dict[str, tuple[str, str]] = {}

    def register(self, name: str, module_path: str, class_name: str) -> None:
        if name in self._entries:
            raise ValueError(f"{self._kind} {name!r} is already registered")
        self._entries[name] = (module_path, class_name)

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> type[T]:
        if name not in self._entries:
            raise ConfigError(
                f"unknown {self._kind} {name!r}; supported: {', '.join(self.names())}"
            )
        module_path, class_name = self._entries[name]
        cls = getattr(importlib.import_module(module_path), class_name)
        if not (isinstance(cls, type) and issubclass(cls, self._base)):
            raise TypeError(f"{module_path}.{class_name} is not a {self._base.__name__}")
        return cls
