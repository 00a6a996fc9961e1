"""Send every log of a command that runs engines to a file; keep its own output on the terminal.

vLLM and Ray write from many places: Python logging in this process (handlers bound to
``sys.stdout``/``sys.stderr`` at import time), C++ logging of Ray's core worker, ``print``
and C-level writes in the engine core and worker processes (which inherit fds 1 and 2),
and progress bars while weights load. Rebinding Python objects misses most of that, so
fds 1 and 2 themselves are pointed at the log file for the duration; the command writes
its progress bars, tables and status to :class:`Terminal`, streams on duplicates of the
original fds. Nothing is lost: what was meant for the terminal is all in the file.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO


@dataclass(frozen=True)
class Terminal:
    """Where a command's own output goes: ``out`` for results, ``err`` for progress bars."""

    out: TextIO
    err: TextIO


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """``--verbose`` and ``--log-file``, for the commands that run engines."""
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's and Ray's logs on the terminal instead of writing them to a file",
    )
    parser.add_argument(
        "--log-file", type=Path, default=None, help="where the logs go (default: a new file)"
    )


def default_log_path(command: str) -> Path:
    """A fresh file per run under the temp dir, e.g. ``/tmp/tierstore-demo-20260101-120000.log``."""
    import tempfile

    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.gettempdir()) / f"tierstore-{command}-{stamp}-{os.getpid()}.log"


def _flush_all() -> None:
    """Python's buffers and C stdio's (a C library writing to a redirected stdout buffers)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass  # no libc to flush: nothing buffered there either


@contextmanager
def logs_to_file(log_path: Path | None) -> Iterator[Terminal]:
    """Within the block, fds 1 and 2 (this process's and every child's started in it) write
    to ``log_path`` (created or truncated); yields the terminal to write to.

    ``None`` (``--verbose``): nothing is redirected and the terminal is ``sys.stdout`` and
    ``sys.stderr``. Processes still running after the block keep writing to the file, so
    stop engines and Ray inside it.
    """
    if log_path is None:
        yield Terminal(out=sys.stdout, err=sys.stderr)
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _flush_all()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    terminal = Terminal(
        out=os.fdopen(os.dup(saved[1]), "w", buffering=1),
        err=os.fdopen(os.dup(saved[2]), "w", buffering=1),
    )
    try:
        for fd in (1, 2):
            os.dup2(log_fd, fd)
        yield terminal
    finally:
        _flush_all()
        for fd, original in saved.items():
            os.dup2(original, fd)
            os.close(original)
        os.close(log_fd)
        terminal.out.close()
        terminal.err.close()
