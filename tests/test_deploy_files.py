"""docker-compose.yml and the Dockerfile name only commands and files that exist here."""

from __future__ import annotations

from pathlib import Path

import yaml

from osd.cli import SUBCOMMANDS
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
    for package in ("osd", "serving", "trainer", "configs"):
        assert f"COPY {package} ./{package}" in dockerfile
