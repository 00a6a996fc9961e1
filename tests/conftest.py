"""Test-wide settings: Ray's auth mode is set explicitly (Ray 2.60 turns token auth on)."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
