"""``python -m deploy.bench NAME --out DIR``: run a benchmark, write JSON (and plots)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.bench")
    parser.add_argument("name", choices=["disk", "dataplane"], help="which benchmark")
    parser.add_argument("--out", type=Path, default=Path("results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--disk-root", type=Path, default=None, help="where to write (disk)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.name == "disk":
        from deploy.bench import disk

        results = disk.run(args.out, args.disk_root, args.quick)
    else:
        from deploy.bench import dataplane

        results = dataplane.run(args.quick)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
