"""Layers point one way (README, "Layout of the code"): data, control and store (no Ray)
-> the actors -> the vLLM adapter and deploy. Only ``tierstore.spec``, the composition
root vLLM loads, joins the adapter to the actors.

Every module's imports are read with ``ast`` (nothing is imported), so a wrong one fails
here with its file, line and the rule it breaks.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# repository folder -> the package it installs as (pyproject's package-dir)
_FOLDERS = {"tierstore": "tierstore", "actors": "tierstore.actors", "deploy": "tierstore.deploy"}

RAY_FREE = (
    "tierstore",  # the package's __init__ only
    "tierstore.data",
    "tierstore.control",
    "tierstore.store",
    "tierstore.keys",
    "tierstore.config",
    "tierstore.errors",
    "tierstore.fields",  # checks of what crosses a process boundary
    "tierstore.wire",  # the messages that cross one, and their decoding
    "tierstore.wire_nixl",  # a NIXL pull's message
    "tierstore.registry",
    "tierstore.private_files",
)
ROOT = "tierstore.spec"

# layer -> (imports it may not make, why)
_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "ray-free": (
        ("ray", "vllm", "tierstore.actors", "tierstore.vllm", "tierstore.deploy", ROOT),
        "data, control and store know no Ray, no actor and no vLLM",
    ),
    "actors": (
        ("vllm", "tierstore.vllm", "tierstore.deploy", ROOT),
        "the actors are below the vLLM adapter and deploy",
    ),
    "vllm adapter": (
        ("tierstore.actors", "tierstore.deploy", ROOT),
        "the vLLM adapter gets its cluster ports injected by tierstore.spec",
    ),
    "composition root": (("tierstore.deploy",), "tierstore.spec is below deploy"),
    "deploy": ((), ""),
}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in _FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _layer(module: str) -> str:
    if module == ROOT:
        return "composition root"
    for prefix, layer in (
        ("tierstore.actors", "actors"),
        ("tierstore.vllm", "vllm adapter"),
        ("tierstore.connector", "vllm adapter"),  # the connector's stable import path
        ("tierstore.deploy", "deploy"),
    ):
        if _within(module, prefix):
            return layer
    if module == "tierstore" or any(_within(module, p) for p in RAY_FREE[1:]):
        return "ray-free"
    raise AssertionError(f"{module}: no layer; add it to tests/unit/test_layers.py")


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            # `from tierstore import spec` names a module too
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations() -> list[str]:
    found = []
    for module, path in _modules().items():
        layer = _layer(module)
        banned, why = _RULES[layer]
        for line, imported in _imports(module, path):
            bad = next((b for b in banned if _within(imported, b)), None)
            if bad is not None and not _within(module, bad):
                where = path.relative_to(REPO)
                found.append(f"{where}:{line}: {module} ({layer}) imports {imported}: {why}")
    return sorted(set(found))


def test_layers_point_one_way() -> None:
    assert violations() == [], "\n".join(["imports against the layer rule:", *violations()])


def test_every_module_has_a_layer_and_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    modules = _modules()
    assert {"tierstore.store.node_store", "tierstore.actors.clients", ROOT} <= set(modules)
    assert {_layer(m) for m in modules} == set(_RULES)
    # The checker itself can fail: a Ray-free module that imports an actor is named.
    bad = tmp_path / "bad.py"
    bad.write_text("import ray\nfrom tierstore.actors.clients import EvictorClient\n")
    imported = [m for _, m in _imports("tierstore.data.bad", bad)]
    banned, _ = _RULES[_layer("tierstore.data.bad")]
    assert [m for m in imported if any(_within(m, b) for b in banned)] == [
        "ray",
        "tierstore.actors.clients",
        "tierstore.actors.clients.EvictorClient",
    ]


# What a process that only talks to the actors may load of tierstore: the engine's
# scheduler (the manager) and anything holding a client load no tier, index or store.
_CLIENT_SIDE_OK = (
    "tierstore.actors",
    "tierstore.vllm",
    "tierstore.wire",
    "tierstore.wire_nixl",
    "tierstore.fields",
)
_CLIENT_SIDE_OK_EXACT = {"tierstore", "tierstore.config", "tierstore.errors", "tierstore.keys"}


def test_a_client_side_process_loads_no_tier_index_or_store_code() -> None:
    code = (
        "import sys, tierstore.actors.clients, tierstore.vllm.manager;"
        "print(*sorted(m for m in sys.modules if m.startswith('tierstore')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    loaded = result.stdout.split()
    assert "tierstore.wire" in loaded
    assert [
        m
        for m in loaded
        if m not in _CLIENT_SIDE_OK_EXACT and not any(_within(m, p) for p in _CLIENT_SIDE_OK)
    ] == []
