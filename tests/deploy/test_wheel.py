"""The wheel installs one import package, ``tierstore``, with ``actors/`` and ``deploy/``
inside it: no top-level ``actors`` or ``deploy`` (other distributions own those names)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support import can_build_c

REPO = Path(__file__).resolve().parents[2]
# repository folder -> the package it installs as
_MAPPED = {"tierstore": "tierstore", "actors": "tierstore/actors", "deploy": "tierstore/deploy"}


def _build_wheel(out: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("tierstore-*.whl")
    return wheel


def test_wheel_has_one_top_level_package_holding_every_module(tmp_path: Path) -> None:
    names = zipfile.ZipFile(_build_wheel(tmp_path)).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"tierstore"}

    expected = {
        f"{_MAPPED[path.parts[0]]}/{'/'.join(path.parts[1:])}"
        for folder in _MAPPED
        for path in (p.relative_to(REPO) for p in (REPO / folder).rglob("*.py"))
        if "__pycache__" not in path.parts
    }
    missing = sorted(expected - set(names))
    assert not missing, f"modules left out of the wheel (add their package to pyproject): {missing}"
    if can_build_c():  # the C modules (optional without a compiler)
        assert any(n.startswith("tierstore/data/_fused_copy.") for n in names), names
        assert any(n.startswith("tierstore/control/_compact_index.") for n in names), names
