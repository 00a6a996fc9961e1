"""``python -m deploy.bench NAME --out DIR``: run a benchmark, write JSON (and plots)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

# name -> module under deploy.bench; each has ``run(args) -> dict`` (JSON-able results).
BENCHMARKS: dict[str, str] = {
    "disk": "deploy.bench.disk",
    "dataplane": "deploy.bench.dataplane",
}


def _run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    module = importlib.import_module(BENCHMARKS[name])
    if name == "disk":
        return module.run(args.out, args.disk_root, args.quick)
    if name == "dataplane":
        return module.run(args.quick)
    return module.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.bench")
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--out", type=Path, default=Path("results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--disk-root", type=Path, default=None, help="where to write (disk)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    results = _run(args.name, args)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
