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
    # The trainer service scales (`--scale trainer=N`): each container is one worker of a pool,
    # its overrides valid for the config it names.
    trainer = services["trainer"]["command"]
    overrides = [arg for arg in trainer[2:] if "=" in arg and not arg.startswith("-")]
    assert "trainer.pool=true" in overrides
    config_path = ROOT / trainer[trainer.index("--config") + 1]
    assert load_config(config_path, overrides).trainer.pool
    assert "container_name" not in services["trainer"]  # a fixed name cannot scale
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


def test_compose_runs_prometheus_over_the_app_and_grafana_with_the_dashboard():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("prometheus", "grafana"):
        for mount in services[name]["volumes"]:
            source = mount.split(":")[0]
            assert not source.startswith("./") or (ROOT / source).exists(), mount
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["serve:8000"] and scrape["scrape_configs"][0]["metrics_path"] == "/metrics"
    assert "GRAFANA_ADMIN_PASSWORD" in (ROOT / ".env.example").read_text()


def test_every_series_the_dashboard_reads_is_one_a_replica_exports():
    """The dashboard's queries name only metrics serving/metrics.py exports (vLLM's names
    included), so a renamed metric fails here, not on a blank panel."""
    import json
    import re

    from serving.metrics import ReplicaMetrics

    metrics = ReplicaMetrics()
    metrics.observe_generation("general", 1, "sql", 3, [0, 2], [0, 1], {"draft": [1, 2, 1]})
    metrics.observe_latency(1.0, 0.1)
    metrics.observe_itl(0.01)
    metrics.adapter_swapped("sql")
    metrics.adapter_rolled_back("sql")
    metrics.loop_part_ok.labels("trainer").set(1)
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in metrics.export().decode().splitlines()
        if line and not line.startswith("#")
    }
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/osd.json").read_text())
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names |= set(re.findall(r"\b((?:vllm:|osd_)[a-z_:]+)", target["expr"]))
    assert names and names <= exported, names - exported
    assert any(n.startswith("vllm:spec_decode") for n in names)
