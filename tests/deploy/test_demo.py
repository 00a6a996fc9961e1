"""``tierstore demo`` as a user runs it: the table and status on the terminal, vLLM's and
Ray's logs (the engine core's included) in the file it names, and a quiet shutdown."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

_DEMO_TIMEOUT_S = 900  # about two minutes alone: an engine start and 18 requests
# What vLLM's and Ray's log lines, and a shutdown that reads as a crash, look like.
_LOG_MARKERS = ("INFO", "WARNING", "ERROR", "(EngineCore", "(MainProcess", "(Worker", "Triton")
_CRASH_MARKERS = ("SIGTERM", "Traceback", "logging.cc", "*** ")


def test_demo_shows_its_table_and_status_and_sends_every_log_to_the_file() -> None:
    cli = os.path.join(os.path.dirname(sys.executable), "tierstore")
    demo = subprocess.run([cli, "demo"], capture_output=True, text=True, timeout=_DEMO_TIMEOUT_S)
    terminal = demo.stdout + demo.stderr
    assert demo.returncode == 0, terminal[-6000:]

    assert "pass 1: tierstore" in demo.stdout and "same output" in demo.stdout  # the table
    assert re.search(r"^\s+8 +880 \|", demo.stdout, re.M)  # its last request's row
    assert "hit rate" in demo.stdout and "cpu" in demo.stdout  # the status
    for line in terminal.splitlines():
        assert not any(m in line for m in _LOG_MARKERS + _CRASH_MARKERS), line

    named = re.search(r"^vLLM and Ray logs: (\S+)$", demo.stderr, re.M)
    assert named, demo.stderr
    log_file = Path(named.group(1))
    log = log_file.read_text()
    log_file.unlink()
    assert "Started a local Ray instance" in log  # Ray, in this process
    assert "(EngineCore" in log and "Initializing a V1 LLM engine" in log  # the engine core
    assert "[shutdown] EngineCore: exiting busy loop" in log  # stopped, in order
    assert "SIGTERM received" not in log  # and without Ray's failure-handler dump
