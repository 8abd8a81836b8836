"""LocalRedis: a private redis-server that starts, stops, survives kill and restart."""

from __future__ import annotations

import pytest
import redis

from osd.buffer.redis_server import (
    PROCESS_CRASH_SAFE_ARGS,
    LocalRedis,
    RedisServerError,
    connect,
    redact_url,
)

pytestmark = pytest.mark.timeout(60)


def test_server_answers_ping_and_stops_cleanly() -> None:
    with LocalRedis() as server:
        assert server.running and server.pid is not None
        assert connect(server.url).ping()
        data_dir = server.data_dir
        server.stop()
        assert not server.running and server.pid is None
    assert not data_dir.exists()


def test_restart_after_sigkill_keeps_data_on_the_same_port() -> None:
    with LocalRedis(extra_args=PROCESS_CRASH_SAFE_ARGS) as server:
        port = server.port
        connect(server.url).set("key", "value")
        server.kill()
        assert not server.running
        with pytest.raises(redis.ConnectionError):
            connect(server.url, connect_timeout_s=0.2).ping()
        server.restart()
        assert server.port == port
        assert connect(server.url).get("key") == b"value"


def test_clean_stop_and_start_keeps_data() -> None:
    with LocalRedis() as server:
        connect(server.url).xadd("s", {"r": b"x"})
        server.stop()
        server.start()
        assert connect(server.url).xlen("s") == 1


def test_password_is_required_and_carried_by_the_url() -> None:
    with LocalRedis(password="s3cret/with:odd@chars") as server:
        assert connect(server.url).ping()
        bare = f"redis://127.0.0.1:{server.port}/0"
        with pytest.raises(redis.AuthenticationError):
            connect(bare).ping()


def test_missing_executable_raises_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="not on PATH"):
        LocalRedis(executable="no-such-redis-server")


def test_failed_start_reports_the_server_log() -> None:
    server = LocalRedis(extra_args=["--no-such-option", "1"])
    try:
        with pytest.raises(RedisServerError, match="(?s)exited with code .*no-such-option"):
            server.start()
    finally:
        server.close()


def test_port_in_use_is_reported_when_the_caller_chose_it() -> None:
    with LocalRedis() as first:
        second = LocalRedis(port=first.port, start_timeout_s=5)
        try:
            with pytest.raises(RedisServerError, match="(?i)address already in use"):
                second.start()
        finally:
            second.close()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@host:1/0", "redis://:***@host:1/0"),
        ("redis://user:pw@host/2", "redis://user:***@host/2"),
    ],
)
def test_redact_url_hides_passwords(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_connect_rejects_non_redis_urls() -> None:
    with pytest.raises(ValueError, match="not a Redis URL"):
        connect("http://:secret@localhost:6379")
