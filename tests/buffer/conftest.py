"""Fixtures for the log buffer tests: real redis-server processes started with LocalRedis."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest

from osd.buffer.redis_server import PROCESS_CRASH_SAFE_ARGS, LocalRedis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of one redis-server shared by the whole session; tests use their own stream keys."""
    with LocalRedis() as server:
        yield server.url


@pytest.fixture
def private_redis() -> Iterator[LocalRedis]:
    """A redis-server of the test's own, for tests that kill or restart it."""
    with LocalRedis(extra_args=PROCESS_CRASH_SAFE_ARGS) as server:
        yield server


@pytest.fixture
def stream() -> str:
    """A fresh stream key, so tests sharing a server never see each other's entries."""
    return f"test:{uuid.uuid4().hex[:12]}"


@pytest.fixture
def unreachable_url() -> str:
    """A Redis URL on a localhost port where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"
