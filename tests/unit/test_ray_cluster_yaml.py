"""ray_cluster.yaml passes Ray's own launcher validation and calls the CLI as it exists."""

from __future__ import annotations

import copy
import shlex
import stat
import subprocess
from pathlib import Path

import click
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from tierstore.deploy.cli import _config_from_flags, build_parser

CONFIG = Path(__file__).resolve().parents[2] / "ray_cluster.yaml"


def _load() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def test_config_passes_the_validation_ray_up_runs() -> None:
    validate_config(prepare_config(_load()))


def test_local_provider_rejects_node_types_so_the_file_has_none() -> None:
    config = _load()
    assert config["provider"]["type"] == "local"
    assert "available_node_types" not in config and "head_node_type" not in config
    broken = copy.deepcopy(config)
    broken["available_node_types"] = {"head": {"node_config": {}, "resources": {}}}
    # The trap this file must not fall into: the launcher aborts.
    with pytest.raises(click.ClickException, match="not supported for on-premise"):
        validate_config(prepare_config(broken))


def test_every_ray_start_sets_the_auth_mode_and_the_head_starts_tierstore() -> None:
    config = _load()
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    for command in starts:
        if " ray start" in command or command.startswith("ray start"):
            assert "RAY_AUTH_MODE=" in command, command
            # Ray's default niceness (15) starves tierstore's actors beside a CPU engine.
            assert "RAY_worker_niceness=0 " in command, command
    assert any("auth_token" in str(k) for k in config["file_mounts"])
    tierstore_up = [c for c in config["head_start_ray_commands"] if "tierstore up" in c]
    assert len(tierstore_up) == 1


def test_cli_commands_in_the_file_parse() -> None:
    for command in _load()["head_start_ray_commands"]:
        if "tierstore up" not in command:
            continue
        words = shlex.split(command)
        args = build_parser().parse_args(words[words.index("up") :])
        assert args.command == "up"
        # The values pass the same validation as an engine's config, not only the parser.
        cfg = _config_from_flags(args)
        assert cfg.cpu_bytes_per_node > 0 and cfg.disk_path and cfg.disk_bytes_per_node > 0


def test_setup_installs_tierstore_with_the_repo_script() -> None:
    assert any("deploy/setup.sh" in c for c in _load()["setup_commands"])


def test_the_bootstraps_ray_start_unstarves_workers_unless_told_otherwise() -> None:
    from tierstore.actors.bootstrap import ray_start_env

    assert ray_start_env({"PATH": "/bin"}) == {"PATH": "/bin", "RAY_worker_niceness": "0"}
    assert ray_start_env({"RAY_worker_niceness": "5"})["RAY_worker_niceness"] == "5"


def _before_ray_start(commands: list[str]) -> list[str]:
    start = next(i for i, c in enumerate(commands) if "ray start" in c)
    return commands[:start]


@pytest.mark.parametrize("node", ["head", "worker"])
def test_every_node_makes_its_token_copy_private_before_ray_start(
    node: str, tmp_path: Path
) -> None:
    """rsync copies the token with its source's mode (Ray writes it 0644): the commands
    each node runs before `ray start`, run here on such a copy, leave it 0600 in a 0700
    ~/.ray."""
    commands = _before_ray_start(_load()[f"{node}_start_ray_commands"])
    own = [c for c in commands if "auth_token" in c]
    assert own, f"{node}: nothing makes the token private before `ray start`"
    ray_dir = tmp_path / ".ray"
    ray_dir.mkdir(mode=0o755)
    token = ray_dir / "auth_token"
    token.write_text("secret")
    token.chmod(0o644)
    for command in own:
        subprocess.run(["bash", "-c", command], env={"HOME": str(tmp_path)}, check=True)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(ray_dir.stat().st_mode) == 0o700


def test_the_dashboard_listens_on_loopback_only() -> None:
    (start,) = [c for c in _load()["head_start_ray_commands"] if "ray start" in c]
    hosts = [w.split("=", 1)[1] for w in shlex.split(start) if w.startswith("--dashboard-host")]
    assert hosts == ["127.0.0.1"]
    assert "0.0.0.0" not in CONFIG.read_text().split("cluster_name:", 1)[1]
