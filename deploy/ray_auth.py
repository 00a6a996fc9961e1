"""Ray token authentication for a process and everything it starts, as Ray 2.60 runs by
default: the tests' session and the soak benchmark use it.

Ray reads ``RAY_AUTH_MODE`` and the token from the environment of every process: a
driver's ``ray.init``, ``ray start`` and the daemons it starts (which pass it on to the
workers and a job's driver), ``ray.cluster_utils`` nodes, the ``ray job`` client (as an
HTTP header to the dashboard). The token is looked up in ``RAY_AUTH_TOKEN``, then the
file ``RAY_AUTH_TOKEN_PATH`` names, then ``~/.ray/auth_token``. Here it goes in the
environment only, which no other user can read: nothing is written to a file, and the
user's ``~/.ray`` is left alone (a ``ray.init`` that starts a cluster in token mode with
no token anywhere would write one there).

Importing this module does not import Ray.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import MutableMapping

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


def token_auth(environ: MutableMapping[str, str] | None = None, force: bool = False) -> str:
    """Token auth in ``environ`` (default: this process's, inherited by every process it
    starts); returns the auth mode now set.

    What the caller already chose is kept: a mode set in ``RAY_AUTH_MODE`` (``force``
    overrides it with ``token``), a token in ``RAY_AUTH_TOKEN`` or in the file
    ``RAY_AUTH_TOKEN_PATH`` names. Otherwise the token is a fresh random one, good for
    the clusters this process and its children start. Set it before this process starts
    a Ray node or connects to one; if Ray is already imported, its cached mode and token
    are refreshed.
    """
    env = os.environ if environ is None else environ
    if force:
        env[MODE_ENV] = "token"
    else:
        env.setdefault(MODE_ENV, "token")
    if env[MODE_ENV].lower() == "token" and not (env.get(TOKEN_ENV) or env.get(TOKEN_PATH_ENV)):
        env[TOKEN_ENV] = secrets.token_hex(32)
    if env is os.environ and "ray" in sys.modules:
        from ray._private.authentication_test_utils import reset_auth_token_state

        reset_auth_token_state()
    return env[MODE_ENV]
