"""Fixtures for serving tests: a real redis-server, a local Ray, the Serve app with toy models."""

from __future__ import annotations

import socket

import pytest

from osd.buffer.redis_server import LocalRedis
from osd.config import load_config

# A fixed k: the toy draft costs about what the toy target does, so k "auto" (the default)
# rightly drafts nothing on it, and these tests are about drafting with adapters. The
# controller over HTTP has its own test (test_app.py).
TOY = [
    "model.target=toy:target",
    "model.draft=toy:draft",
    "model.adapters=[general,code]",
    "spec.num_spec_tokens=4",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serving_redis():
    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="session")
def ray_serve_app(serving_redis):
    """The Serve app on a free port: (base_url, config)."""
    import ray
    from ray import serve

    from serving.app import build_app

    port = free_port()
    config = load_config(
        None,
        [
            *TOY,
            f"serve.port={port}",
            "adapters.reconcile_interval_s=0.5",
            "adapters.rollback_window=40",
            "serve.max_ongoing_requests=4",
        ],
    )
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config, serving_redis.url), name="osd", route_prefix="/")
    yield f"http://127.0.0.1:{port}", config
    serve.shutdown()
    ray.shutdown()
