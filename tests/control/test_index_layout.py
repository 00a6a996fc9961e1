"""The index's layout: one entry point over parts that do not shadow each other.

``tierstore.control.index`` is where every other module imports the index's names from,
though most are defined in its part modules; and ``ChunkIndex`` is built from mixins, so
a method defined in two parts would silently hide one of them.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from tierstore.control import index
from tierstore.control.index import ChunkIndex
from tierstore.control.index_state import IndexState

ROOT = Path(__file__).resolve().parents[2]


def test_every_name_imported_from_the_index_module_is_exported_there() -> None:
    imported: dict[str, set[str]] = {}
    for folder in ("tierstore", "actors", "deploy", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module == "tierstore.control.index":
                    for alias in node.names:
                        imported.setdefault(alias.name, set()).add(path.name)
    assert {"ChunkIndex", "LookupState", "ShardOffer"} <= set(imported)  # the scan works
    missing = {name: files for name, files in imported.items() if name not in index.__all__}
    assert not missing, f"import these from index.py's __all__: {missing}"
    assert all(hasattr(index, name) for name in index.__all__)


def test_no_part_of_the_index_shadows_another() -> None:
    owners: dict[str, list[str]] = {}
    for part in ChunkIndex.__mro__:
        if part is object:
            continue
        for name, value in vars(part).items():
            if inspect.isfunction(value) or isinstance(value, staticmethod):
                owners.setdefault(name, []).append(part.__name__)
    shadowed = {name: parts for name, parts in owners.items() if len(parts) > 1}
    assert not shadowed
    assert all(issubclass(part, IndexState) for part in ChunkIndex.__mro__[:-1])
