"""docker-compose.yml and the Dockerfile name only commands and files that exist here."""

from __future__ import annotations

from pathlib import Path

import yaml

from launcher.cli import SUBCOMMANDS
from osd.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_run_existing_commands_with_existing_configs():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "serve", "trainer"} <= set(services)
    assert "--appendonly" in services["redis"]["command"]
    assert "--requirepass" in services["redis"]["command"]
    for name in ("serve", "trainer"):
        command = services[name]["command"]
        assert command[0] == "osd" and command[1] in SUBCOMMANDS, command
        config = command[command.index("--config") + 1]
        assert (ROOT / config).exists()
        load_config(ROOT / config)
        assert "healthcheck" in services[name]
        assert services[name]["build"] == "."
    assert (ROOT / "Dockerfile").exists() and (ROOT / ".env.example").exists()
    assert "REDIS_PASSWORD" in (ROOT / ".env.example").read_text()


def test_dockerfile_copies_the_packages():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("osd", "serving", "trainer", "launcher", "configs"):
        assert f"COPY {package} ./{package}" in dockerfile


def _bytes(size: str) -> int:
    units = {"kb": 2**10, "mb": 2**20, "gb": 2**30}
    return int(size[:-2]) * units[size[-2:].lower()] if size[-2:].lower() in units else int(size)


def test_compose_redis_is_bounded_and_never_evicts_with_the_log_well_under_it():
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["redis"][
        "command"
    ]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"  # adapter keys stay
    maxmemory = _bytes(command[command.index("--maxmemory") + 1])
    log = load_config(ROOT / "configs/production.yaml").log
    assert 0 < log.max_bytes <= maxmemory // 2  # room for adapter versions (docs/capacity.md)
