"""The serve helper's command line: what it exposes unless told otherwise."""

from __future__ import annotations

from tierstore.deploy.serve import serve_command


def test_the_serve_helper_listens_on_loopback_unless_told_otherwise() -> None:
    def host_of(argv: list[str]) -> list[str]:
        return [argv[i + 1] for i, word in enumerate(argv) if word == "--host"]

    extra = {"cpu_bytes_per_node": "1GiB"}
    assert host_of(serve_command("model", extra, port=8000)) == ["127.0.0.1"]
    assert host_of(serve_command("model", extra, host="0.0.0.0")) == ["0.0.0.0"]
