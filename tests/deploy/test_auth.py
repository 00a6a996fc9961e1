"""Ray token authentication, on for the whole suite (tests/conftest.py), as Ray 2.60 runs
by default: a private ``ray start --head`` refuses every client without its token, on
the GCS (``ray.init``, ``tierstore status``) and on the dashboard (``ray job``), and
admits one with it.

A refused ``ray.init`` does not say so: the GCS answers ``Unauthenticated``, the client
logs it and retries, and after ~20 s raises a ``ConnectionError``. So the refused
clients run at once, each with a deadline, and the refusal is read from their log.

Not skipped when a caller turns auth off (``RAY_AUTH_MODE=disabled``): the clients are
then admitted, and these tests say so.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from tierstore.deploy.ray_auth import MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV

from tests.deploy.conftest import RayHead

_CLIENT_TIMEOUT_S = 120  # a refused ray.init gives up after ~20 s
_REFUSED = "Authentication token is missing or incorrect"  # the GCS's answer, in the log

_JOIN = """
import sys
import ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
except Exception as exc:
    print(f"REFUSED {type(exc).__name__}: {exc}")
    sys.exit(3)
print("JOINED", ray.get(ray.put(7)))
"""


def _env(head: RayHead, home: Path, **auth: str) -> dict[str, str]:
    """The head's environment with only the auth settings given: no token otherwise, not
    even a ~/.ray/auth_token (HOME is a fresh folder)."""
    env = {k: v for k, v in head.env.items() if k not in (TOKEN_ENV, TOKEN_PATH_ENV)}
    home.mkdir()
    return {**env, "HOME": str(home), **auth}


def _start(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=_CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"a client was neither refused nor admitted in {_CLIENT_TIMEOUT_S} s:\n{err}")
    return proc.returncode, out + err


def test_a_client_without_the_token_is_refused(ray_head: RayHead, tmp_path: Path) -> None:
    gcs = f"127.0.0.1:{ray_head.gcs_port}"
    bin_dir = os.path.dirname(sys.executable)
    wrong = {MODE_ENV: "token", TOKEN_ENV: secrets.token_hex(32)}
    clients = {
        "wrong token": _start(
            [sys.executable, "-c", _JOIN, gcs], _env(ray_head, tmp_path / "a", **wrong)
        ),
        "no token sent": _start(
            [sys.executable, "-c", _JOIN, gcs],
            _env(ray_head, tmp_path / "b", **{MODE_ENV: "disabled"}),
        ),
        "tierstore status, wrong token": _start(
            [os.path.join(bin_dir, "tierstore"), "status", f"--address={gcs}"],
            _env(ray_head, tmp_path / "c", **wrong),
        ),
    }
    for what, proc in clients.items():
        rc, log = _finish(proc)
        assert rc != 0, f"{what}: admitted\n{log[-4000:]}"
        assert _REFUSED in log, f"{what}: failed, but not for its token\n{log[-4000:]}"
        if what != "tierstore status, wrong token":
            assert "REFUSED ConnectionError" in log, log[-4000:]

    # The same client with the session's token joins, and puts and gets an object.
    rc, log = _finish(_start([sys.executable, "-c", _JOIN, gcs], ray_head.env))
    assert rc == 0 and "JOINED 7" in log, log[-4000:]


def test_the_dashboard_refuses_a_job_client_without_the_token(
    ray_head: RayHead, tmp_path: Path
) -> None:
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    jobs = [ray_cli, "job", "list", "--address", ray_head.dashboard_url]
    wrong = _env(ray_head, tmp_path / "a", **{MODE_ENV: "token", TOKEN_ENV: secrets.token_hex(32)})
    rc, log = _finish(_start(jobs, wrong))
    assert rc != 0, log[-4000:]
    assert "403" in log or "Forbidden" in log, log[-4000:]

    rc, log = _finish(_start(jobs, _env(ray_head, tmp_path / "b", **{MODE_ENV: "disabled"})))
    assert rc != 0, log[-4000:]
    assert "401" in log or "Unauthorized" in log, log[-4000:]

    rc, log = _finish(_start(jobs, ray_head.env))
    assert rc == 0, log[-4000:]
