"""The type checker over the library, as it is installed: ``tierstore`` with the
repository's ``actors/`` and ``deploy/`` as ``tierstore.actors`` and ``tierstore.deploy``
(pyproject's package-dir, which mypy cannot read). A tree of links gives mypy that
layout; the settings are pyproject's ``[tool.mypy]``. Zero errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def installed_layout(root: Path) -> Path:
    """``root/tierstore``: links to every entry of the repository's ``tierstore/``, plus
    ``actors`` and ``deploy``."""
    package = root / "tierstore"
    package.mkdir()
    for entry in (REPO / "tierstore").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "actors").symlink_to(REPO / "actors")
    (package / "deploy").symlink_to(REPO / "deploy")
    return root


def test_the_library_type_checks(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    root = installed_layout(tmp_path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(REPO / "pyproject.toml"),
            "--cache-dir",
            str(REPO / ".mypy_cache"),
            "-p",
            "tierstore",
        ],
        cwd=root,
        env={**os.environ, "MYPYPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
