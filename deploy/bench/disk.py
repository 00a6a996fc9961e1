"""Disk tier throughput against plain sequential file I/O of the same bytes, same disk, same run.

Also: promotion latency (disk -> verified -> CPU tier) per chunk size. Page-cache effects
hit both sides alike; when the process may drop caches (root on Linux), reads are also
measured cold.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tierstore.data.checksum import digest
from tierstore.data.tiers.base import ShardMeta, StoredShard
from tierstore.data.tiers.disk import DiskTier
from tierstore.data.tiers.memory import MemoryTier
from tierstore.keys import ChunkKey, Namespace, ShardId

NS = Namespace("be0c4")


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _plain_write(folder: Path, chunks: list[np.ndarray], fsync: bool) -> float:
    started = time.perf_counter()
    for i, data in enumerate(chunks):
        with open(folder / f"plain-{i}", "wb") as f:
            f.write(memoryview(data))
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return time.perf_counter() - started


def _plain_read(folder: Path, n: int, nbytes: int) -> float:
    started = time.perf_counter()
    for i in range(n):
        out = np.empty(nbytes, dtype=np.uint8)
        with open(folder / f"plain-{i}", "rb") as f:
            f.readinto(memoryview(out))
    return time.perf_counter() - started


def _shard_id(i: int) -> ShardId:
    return ShardId(NS, ChunkKey(i.to_bytes(8, "big") + b"\0\0\0\0"), 0)


def bench_throughput(chunk_bytes: int, n_chunks: int, fsync: bool, root: Path) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 255, chunk_bytes, dtype=np.uint8) for _ in range(n_chunks)]
    shards = [StoredShard(ShardMeta(chunk_bytes, digest(c), 1), c) for c in chunks]
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        folder = Path(tmp)
        tier = DiskTier(folder / "tier", chunk_bytes * n_chunks * 2, fsync=fsync)
        plain_w = _plain_write(folder, chunks, fsync)
        started = time.perf_counter()
        for i, shard in enumerate(shards):
            tier.put(_shard_id(i), shard)
        tier_w = time.perf_counter() - started
        cold = _drop_page_cache()
        plain_r = _plain_read(folder, n_chunks, chunk_bytes)
        _drop_page_cache()
        started = time.perf_counter()
        for i in range(n_chunks):
            tier.get(_shard_id(i))  # read + length + xxh3 verification
        tier_r = time.perf_counter() - started
    total_mb = chunk_bytes * n_chunks / 1e6
    return {
        "chunk_bytes": chunk_bytes,
        "chunks": n_chunks,
        "fsync": fsync,
        "cold_reads": cold,
        "write_MBps": {"tierstore": total_mb / tier_w, "plain": total_mb / plain_w},
        "read_MBps": {"tierstore": total_mb / tier_r, "plain": total_mb / plain_r},
        "write_ratio": plain_w / tier_w,
        "read_ratio": plain_r / tier_r,
    }


def bench_promotion(chunk_bytes: int, n: int, root: Path) -> dict[str, Any]:
    """Disk -> CPU tier per chunk, as a NodeStore promotes before answering HIT."""
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        disk = DiskTier(Path(tmp), chunk_bytes * n * 2)
        cpu = MemoryTier(chunk_bytes * n * 2)
        for i in range(n):
            data = rng.integers(0, 255, chunk_bytes, dtype=np.uint8)
            disk.put(_shard_id(i), StoredShard(ShardMeta(chunk_bytes, digest(data), 1), data))
        _drop_page_cache()
        times = []
        for i in range(n):
            started = time.perf_counter()
            cpu.put(_shard_id(i), disk.get(_shard_id(i)))
            times.append(time.perf_counter() - started)
    times.sort()
    return {
        "chunk_bytes": chunk_bytes,
        "p50_ms": 1e3 * statistics.median(times),
        "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
    }


def bench_put_cpu(chunk_bytes: int, n: int, root: Path) -> dict[str, Any]:
    """CPU time per chunk write, what the NodeStore's write-through spends of a core the
    engine also wants: into a tier that grows, into a full one (each write after a
    delete, as an evicting cache does), and one new file per chunk (the layout before
    slab files) for scale."""
    data = np.random.default_rng(2).integers(0, 255, chunk_bytes, dtype=np.uint8)
    shard = StoredShard(ShardMeta(chunk_bytes, digest(data), 1), data)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        tier = DiskTier(Path(tmp) / "tier", chunk_bytes * n)
        started = time.process_time()
        for i in range(n):
            tier.put(_shard_id(i), shard)
        growing = time.process_time() - started
        started = time.process_time()
        for i in range(n, 2 * n):
            tier.delete(_shard_id(i - n))
            tier.put(_shard_id(i), shard)
        full = time.process_time() - started
        folder = Path(tmp) / "files"
        folder.mkdir()
        started = time.process_time()
        _plain_write(folder, [data] * n, fsync=False)
        files = time.process_time() - started
    return {
        "chunk_bytes": chunk_bytes,
        "chunks": n,
        "cpu_ms_per_put": {
            "growing": 1e3 * growing / n,
            "full": 1e3 * full / n,
            "file_per_chunk": 1e3 * files / n,
        },
    }


def run(out_dir: Path, root: Path | None = None, quick: bool = False) -> dict[str, Any]:
    root = root or Path(tempfile.gettempdir())
    sizes = [256 << 10, 2 << 20] if quick else [64 << 10, 256 << 10, 2 << 20, 16 << 20]
    volume = (16 << 20) if quick else (256 << 20)
    results: dict[str, Any] = {
        "throughput": [
            bench_throughput(size, max(4, volume // size), fsync, root)
            for size in sizes
            for fsync in (False, True)
        ],
        "promotion": [bench_promotion(size, 8 if quick else 32, root) for size in sizes],
        "put_cpu": [
            bench_put_cpu(size, 200 if quick else 2000, root) for size in (32 << 10, 256 << 10)
        ],
    }
    return results


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    from tierstore.deploy.bench import plots

    rows = results["throughput"]
    labels = [f"{r['chunk_bytes'] >> 10} KiB{' fsync' if r['fsync'] else ''}" for r in rows]
    series = {
        f"{side} {op}": [r[f"{op}_MBps"][side] for r in rows]
        for op in ("write", "read")
        for side in ("tierstore", "plain")
    }
    promotion = results["promotion"]
    return [
        plots.bars(
            out / "disk_throughput.png",
            "Disk tier vs plain file I/O (MB/s)",
            "MB/s (log)",
            labels,
            series,
            log=True,
        ),
        plots.lines(
            out / "disk_promotion.png",
            "Promotion latency: disk -> verified -> CPU tier",
            "chunk KiB",
            "ms",
            [p["chunk_bytes"] >> 10 for p in promotion],
            {q: [p[f"{q}_ms"] for p in promotion] for q in ("p50", "p90")},
            logx=True,
            logy=True,
        ),
    ]
