"""Fixtures for serving tests: a real redis-server, a local Ray, Serve apps with toy models.

One Ray and one Serve HTTP proxy serve the whole session (:func:`serve_port`); each app is
deployed on it under its own route prefix (:func:`serve_app`). Most tests share the session's
app (:func:`ray_serve_app`); a test that breaks its app (kills the replica, floods it) deploys
its own, so it neither needs to run last nor leaves a damaged app to the tests after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from launcher.stack import free_port  # noqa: F401 - the launcher's tests take it from here
from osd.buffer.redis_server import LocalRedis
from osd.config import OSDConfig, load_config

# A fixed k: the toy draft costs about what the toy target does, so k "auto" (the default)
# rightly drafts nothing on it, and these tests are about drafting with adapters. The
# controller over HTTP has its own test (test_app.py).
TOY = [
    "model.target=toy:target",
    "model.draft=toy:draft",
    "model.adapters=[general,code]",
    "spec.num_spec_tokens=4",
]


@pytest.fixture(scope="session")
def serving_redis():
    with LocalRedis() as server:
        yield server


@contextlib.contextmanager
def serve_app(
    port: int, redis_url: str, name: str, route_prefix: str = "/", *overrides: str
) -> Iterator[tuple[str, OSDConfig]]:
    """Deploys the osd app with one toy replica as ``name`` under ``route_prefix`` until the
    block ends: (its base URL, its config). ``overrides`` go after the defaults here. Each
    replica asks Ray for half a core, so the session's app and a module's own fit together on
    the two cores (:func:`tests.conftest.serve_port`)."""
    from ray import serve

    from serving.app import build_app

    config = load_config(
        None,
        [
            *TOY,
            f"serve.port={port}",
            "adapters.reconcile_interval_s=0.5",
            "adapters.rollback_window=40",
            "serve.max_ongoing_requests=4",
            "serve.num_cpus=0.5",
            *overrides,
        ],
    )
    serve.run(build_app(config, redis_url), name=name, route_prefix=route_prefix)
    try:
        yield f"http://127.0.0.1:{port}{route_prefix.rstrip('/')}", config
    finally:
        serve.delete(name)


@pytest.fixture(scope="session")
def ray_serve_app(serve_port, serving_redis):
    """The session's shared Serve app at the root: (base_url, config)."""
    with serve_app(serve_port, serving_redis.url, "osd") as app:
        yield app


@pytest.fixture(scope="module")
def client(replica):
    """The official OpenAI client on the module's ``replica`` (a fixture each such module
    defines: its models and template)."""
    return replica.openai()
