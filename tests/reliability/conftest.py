"""Fixtures for the reliability tests: toy replicas, real redis-servers, and helpers to read them.

Most tests drive a Ray-free replica: a `ReplicaRuntime` with its FastAPI app behind Starlette's
`TestClient`, wired with its `LogWriter`, adapter `VersionWatcher` and loop health probe by the same
`serving.replica.wire_replica` the Ray Serve replica uses (`serving.app.OSDReplica`). Only the tests
about Ray Serve itself start the Serve app, once per module. Faults are real: redis-server processes
are SIGKILLed and restarted, stored bytes are edited in Redis or on disk, replica processes are
SIGKILLed.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from launcher.stack import free_port  # noqa: F401 - the reliability tests take it from here
from osd.adapters.codec import AdapterStore
from osd.adapters.lora import adapter_spec, lora_state_dict
from osd.buffer.redis_server import PROCESS_CRASH_SAFE_ARGS, LocalRedis
from osd.buffer.writer import LogWriter
from osd.config import OSDConfig, load_config
from serving.api import create_api
from serving.health import HealthLimits
from serving.replica import wire_replica
from serving.runtime import ReplicaRuntime
from serving.watcher import VersionWatcher

TOY = [
    "model.target=toy:target",
    "model.draft=toy:draft",
    "model.adapters=[general,code]",
    "serve.max_tokens_limit=8",
    "spec.num_spec_tokens=4",  # fixed: on the toy pair k "auto" drafts nothing (serving conftest)
]
STREAM = "osd:records"  # the default log stream; each test has its own redis-server or reads ids


def toy_config(*overrides: str) -> OSDConfig:
    """The toy deployment (tiny random target and draft, adapters general and code)."""
    return load_config(None, [*TOY, *overrides])


def wait_for(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.02) -> float:
    """Polls until `predicate()` is truthy; returns the seconds it took, or fails the test."""
    start = time.perf_counter()
    while not predicate():
        if time.perf_counter() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s: {predicate}")
        time.sleep(interval_s)
    return time.perf_counter() - start


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process (this one by default), from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc status")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition; 0 if it is absent."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def completion(**fields: Any) -> dict[str, Any]:
    """A small valid /v1/completions body; `fields` override or add."""
    return {"model": "osd", "prompt": "the cat", "max_tokens": 8, "temperature": 0.7, **fields}


def send_and_hang_up(base_url: str, body: dict, read_bytes: int = 0) -> None:
    """POSTs a completion over a raw socket and closes it after reading `read_bytes`.
    `base_url` may end in an app's route prefix (``http://host:port/prefix``)."""
    address, _, prefix = base_url.removeprefix("http://").partition("/")
    host, port = address.split(":")
    payload = json.dumps(body).encode()
    path = f"/{prefix}/v1/completions" if prefix else "/v1/completions"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + payload)
        if read_bytes:
            sock.recv(read_bytes)


@dataclass
class Replica:
    """One Ray-free replica: runtime, HTTP client on its app, log writer and adapter watcher."""

    runtime: ReplicaRuntime
    client: TestClient
    writer: LogWriter | None
    watcher: VersionWatcher | None

    def complete(self, **fields: Any) -> Any:
        return self.client.post("/v1/completions", json=completion(**fields))

    def openai(self, api_key: str = "x") -> Any:
        """The official client, talking to the app in process (TestClient is an httpx.Client)."""
        import openai

        return openai.OpenAI(
            base_url="http://testserver/v1", api_key=api_key, http_client=self.client, max_retries=0
        )

    def health(self) -> dict[str, Any]:
        response = self.client.get("/health")
        assert response.status_code == 200
        return response.json()

    def metrics(self) -> str:
        return self.client.get("/metrics").text

    def current(self, adapter: str = "general") -> int:
        return self.health()["adapters"][adapter]


@contextmanager
def running_replica(
    config: OSDConfig,
    *,
    redis_url: str | None = None,
    store: AdapterStore | None = None,
    reconcile_interval_s: float = 0.2,
    rollback_window: int = 64,
    health_limits: HealthLimits | None = None,
    health_interval_s: float = 0.5,
) -> Iterator[Replica]:
    """A replica wired as `serving.app.OSDReplica` wires one (`wire_replica`): a log writer on
    `redis_url` (if given), an adapter watcher on `store` (if given, its live monitor judging
    versions over `rollback_window` drafted tokens), started before the first request, and its
    loop health probe."""
    writer = None
    if redis_url is not None:
        writer = LogWriter.from_config(redis_url, config.log)
    replica = wire_replica(
        config,
        log_writer=writer,
        store=store,
        redis_url=redis_url or "",
        reconcile_interval_s=reconcile_interval_s,
        rollback_window=rollback_window,
        health_limits=health_limits,
        health_interval_s=health_interval_s,
    )
    try:
        with TestClient(create_api(replica.runtime), raise_server_exceptions=False) as client:
            yield Replica(replica.runtime, client, writer, replica.watcher)
    finally:
        replica.close()


def replica_adapter(model: Any, adapter: str = "general") -> tuple[Any, dict[str, Any]]:
    """(spec, identity weights) shaped like a replica's `adapter`, from its peft draft."""
    spec = adapter_spec(model, f"{adapter}@0", base_model_id="toy:draft")
    return spec, lora_state_dict(model, f"{adapter}@0")  # B = 0: the base draft exactly


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    """A redis-server of the test's own (AOF on), for tests that kill or restart it."""
    with LocalRedis(extra_args=PROCESS_CRASH_SAFE_ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def module_redis() -> Iterator[LocalRedis]:
    """A redis-server shared by one module's tests."""
    with LocalRedis() as server:
        yield server
