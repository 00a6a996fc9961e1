"""vLLM's OpenAI server as the soak drives it: started, health-checked, killed, restarted.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
runs; see :mod:`tierstore.deploy.serve`) in its own process group, so a kill takes its
engine core and worker with it, as a crash of the server's host would.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tierstore.deploy.serve import SERVER_MODULE, serve_command, shell_line, stop_server

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # about a minute alone; several on a loaded machine
_STOP_GRACE_S = 30.0
_RESET_TIMEOUT_S = 60.0
_HTTP_TIMEOUT_S = 10.0
_LOG_TAIL_CHARS = 8_000
_LE = re.compile(r'le="([^"]+)"')


class ApiServer:
    """One server command line; ``start``/``kill`` may be called again and again (the same
    port, the same flags), each start appending to the same log file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.port = int(argv[argv.index("--port") + 1])
        self.base = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> float:
        """Starts the server and waits until /health answers; returns the seconds taken."""
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1
        self._wait_ready()
        return time.monotonic() - started

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(self._failure(f"server exited with {self._proc.returncode}"))
            if self.healthy():
                return
            time.sleep(1.0)
        raise RuntimeError(self._failure(f"server not healthy after {READY_TIMEOUT_S} s"))

    def _failure(self, what: str) -> str:
        tail = self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        return f"{what}\n--- command ---\n{shell_line(self.argv)}\n--- log (tail) ---\n{tail}"

    def healthy(self) -> bool:
        try:
            urllib.request.urlopen(self.base + "/health", timeout=_HTTP_TIMEOUT_S).close()
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals the whole process group and waits for the server to exit."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        stop_server(proc, sig, _STOP_GRACE_S)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def post(self, path: str, timeout_s: float = _HTTP_TIMEOUT_S) -> dict[str, Any]:
        import json

        request = urllib.request.Request(self.base + path, data=b"{}", method="POST")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())

    def reset_prefix_cache(self, external: bool = False) -> None:
        """Empties the device prefix cache (dev endpoint); retried while stores still hold
        blocks. ``external`` also resets the connector's view (the chunks stay)."""
        path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
        deadline = time.monotonic() + _RESET_TIMEOUT_S
        while not self.post(path)["success"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} never succeeded in {_RESET_TIMEOUT_S} s")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        """``tierstore:*`` samples of /metrics, summed over labels but a histogram's ``le``
        (``_created`` left out)."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=_HTTP_TIMEOUT_S) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            metric = name.split("{", 1)[0]
            if metric.startswith("tierstore:") and not metric.endswith("_created"):
                le = _LE.search(name)  # a histogram's buckets stay apart
                key = f'{metric}{{le="{le.group(1)}"}}' if le else metric
                out[key] = out.get(key, 0.0) + float(value)
        return out


def server_argv(
    model: str, port: int, store_extra: dict[str, Any] | None, device_blocks: int
) -> list[str]:
    """The soak's server: fp32, block 32, a small device cache (so prompts come back from
    tierstore, not from vLLM's own prefix cache), token-id prompts. ``store_extra`` None:
    the same server without tierstore (the reference)."""
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": port,
        "dtype": "float32",
        "block_size": 32,
        "max_model_len": 4096,
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "enable_prompt_tokens_details": True,
        "num_gpu_blocks_override": device_blocks,
        "seed": 0,
    }
    if store_extra is not None:
        return serve_command(model, store_extra, **options)
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", model, "--enable-prefix-caching"]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv
