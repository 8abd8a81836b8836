"""The embedded local stack: a private redis-server, a local Ray, the Serve app and the trainer.

Used by ``osd up`` (serve until stopped) and ``osd demo`` (drive traffic, report). While it runs,
a supervisor (`launcher.supervisor`) restarts a redis-server or trainer that dies: Redis on the
same port and data directory (its append-only file keeps published versions and unread
records), the trainer from the store's pointers and its consumer group's pending entries.
Everything it starts it stops again, in reverse order, also on Ctrl-C or SIGTERM: the trainer
runs as a child process in its own process group, Ray's local cluster is shut down, and the
redis-server child is stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from launcher.supervisor import Supervised, Supervisor
from osd.buffer.loop_status import read_beat, trainer_beat_key
from osd.buffer.redis_server import LocalRedis, connect
from osd.closing import Closeable
from osd.config import OSDConfig
from osd.process import die_with_parent_preexec
from osd.threads import child_env
from serving.ingress import Ingress

__all__ = ["LocalStack", "free_port", "install_signal_handlers"]

EMBEDDED_REDIS_MEMORY = "1gb"  # the private redis-server's maxmemory (log.max_bytes fits in it)
_APP = "osd"  # the Serve application's name
# Longest wait for the replica to answer, its warm-up included (2-6 minutes on a 2-core CPU when
# it compiles its forwards the first time).
_READY_S = 1800.0
_SERVE_SHUTDOWN_S = 45.0  # longest wait for Serve's graceful shutdown before stopping Ray


def free_port() -> int:
    """A free TCP port on 127.0.0.1, below the kernel's ephemeral range where there is room.
    A port ``bind(0)`` hands out comes from that range, the one the next outgoing connection's
    local end is taken from too, so a server started on it a moment later can find it taken
    (seen in CI: HAProxy "cannot bind socket (Address already in use)" for the port a test had
    just been given). 20000 and up also stays clear of Ray's worker ports (10002-19999)."""
    ephemeral_low = _ephemeral_low()
    for _ in range(100 if ephemeral_low > 21000 else 0):
        port = random.randrange(20000, ephemeral_low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def install_signal_handlers() -> None:
    """SIGINT, SIGTERM (and SIGHUP) end the run like Ctrl-C, so ``finally`` blocks clean up."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    # A process started in the background by a non-interactive shell inherits SIGINT ignored
    # (and Python then installs no KeyboardInterrupt handler): make Ctrl-C work regardless.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def config_to_yaml(config: OSDConfig) -> str:
    def plain(value: Any) -> Any:
        if isinstance(value, tuple | list):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return yaml.safe_dump(plain(dataclasses.asdict(config)), sort_keys=False)


class LocalStack(Closeable):
    """Starts the whole loop on this machine; ``close()`` stops all of it.

    Args:
        config: the deployment config; ``log.redis_url`` empty means a private redis-server.
        with_trainer: also run ``osd train`` as a child process.
        port: HTTP port (``0``: the config's; ``-1``: any free port).
    """

    def __init__(self, config: OSDConfig, *, with_trainer: bool = True, port: int = 0) -> None:
        if port == -1:
            port = free_port()
        if port:
            serve = dataclasses.replace(config.serve, port=port)
            config = dataclasses.replace(config, serve=serve)
        self.config = config
        self.with_trainer = with_trainer
        self.run_dir = Path(config.run_dir).resolve()
        self.redis: LocalRedis | None = None
        self.redis_url = config.log.redis_url
        self.trainer: subprocess.Popen[bytes] | None = None
        self.supervisor: Supervisor | None = None
        self.ray_session_dir = ""
        self._ray_started = False
        self.ingress: Ingress | None = None

    @property
    def _torch_processes(self) -> int:
        """osd processes running torch on this machine's cores: replicas and the trainer."""
        return self.config.serve.num_replicas + int(self.with_trainer)

    @property
    def base_url(self) -> str:
        return f"http://{self.config.serve.host}:{self.config.serve.port}"

    def start(self) -> LocalStack:
        """Starts every part. Ctrl-C during start-up is held until the part being started is
        up (an interrupt inside Ray's or subprocess's own bookkeeping can hang them), then
        everything started so far is stopped. Waiting for the replica to be ready (its
        warm-up: minutes the first time it compiles) is not held: Ctrl-C stops it within a
        second."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(config_to_yaml(self.config))
        self._build_models()  # interruptible as usual: a build resumes where it stopped
        try:
            with _interrupts_deferred() as interrupted:
                steps = [self._start_redis, lambda: self._start_serve(interrupted)]
                if self.with_trainer:
                    steps.append(self._start_trainer)
                for step in steps:
                    step()
                    if interrupted():
                        raise KeyboardInterrupt("interrupted during start-up")
        except BaseException:
            self.close()
            raise
        self.supervisor = Supervisor(self._supervised()).start()
        return self

    def _supervised(self) -> list[Supervised]:
        parts = []
        if self.redis is not None:
            redis = self.redis
            parts.append(
                Supervised(
                    "redis-server",
                    lambda: _exit_status(redis.exit_code),
                    redis.restart,  # same port and data directory: the AOF is read back
                    hint=str(redis.log_path),
                )
            )
        if self.trainer is not None:
            parts.append(
                Supervised(
                    "trainer",
                    lambda: _exit_status(self.trainer.poll() if self.trainer else None),
                    self._start_trainer,
                    hint=str(self.run_dir / "trainer.log"),
                )
            )
        return parts

    def supervision(self) -> dict[str, dict[str, Any]]:
        """Per supervised process: state (running, restarting, failed), restarts, last exit."""
        return self.supervisor.status() if self.supervisor is not None else {}

    def _build_models(self) -> None:
        if self.config.model.uses_demo_models:  # build once here, not in each replica
            from osd.demo import build_demo_models

            build_demo_models(progress=True)

    def _start_redis(self) -> None:
        if not self.redis_url:
            self.redis = LocalRedis(
                data_dir=str(self.run_dir / "redis"),
                # Bounded; never evicts (adapter versions must not vanish): docs/capacity.md.
                extra_args=[
                    *("--maxmemory", EMBEDDED_REDIS_MEMORY),
                    *("--maxmemory-policy", "noeviction"),
                ],
            ).start()
            self.redis_url = self.redis.url

    def _start_serve(self, interrupted: Callable[[], bool] = lambda: False) -> None:
        import ray
        from ray import serve
        from ray.serve import api as serve_api

        from serving.app import build_app

        self.ingress = Ingress(self.config.serve)
        ingress_env = self.ingress.apply()  # before Ray starts: its processes read it then
        ray.init(
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            runtime_env={"env_vars": {**child_env(self._torch_processes), **ingress_env}},
        )
        self._ray_started = True
        node = getattr(ray._private.worker, "_global_node", None)  # to find its processes
        self.ray_session_dir = node.get_session_dir_path() if node is not None else ""
        s = self.config.serve
        serve.start(http_options={"host": s.host, "port": s.port})
        if s.warmup and self.config.model.compile:
            print(
                "[osd] the replica compiles its model forwards in its warm-up before it serves "
                "(2-6 minutes on a 2-core CPU the first time, about a minute from inductor's "
                "on-disk cache after; model.compile=false skips it)",
                flush=True,
            )
        # Deployed without waiting for it to run (serve.run would wait, deaf to Ctrl-C, for the
        # replica's warm-up); wait_ready then waits, and hears it.
        deploy = getattr(serve_api, "_run", None)
        app = build_app(self.config, self.redis_url)
        if deploy is None:  # a Ray without it: serve.run, which waits
            serve.run(app, name=_APP, route_prefix="/")
        else:
            deploy(app, _blocking=False, name=_APP, route_prefix="/")
        self.wait_ready(interrupted=interrupted)

    def _start_trainer(self) -> None:
        log = open(self.run_dir / "trainer.log", "ab")  # noqa: SIM115 - owned by the child
        self.trainer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launcher.cli",
                "train",
                "--config",
                str(self.run_dir / "config.yaml"),
                "--redis-url",
                self.redis_url,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent_preexec(),  # no orphaned trainer if this process is killed
            env={**os.environ, **child_env(self._torch_processes)},
        )

    def wait_ready(
        self, timeout_s: float = _READY_S, interrupted: Callable[[], bool] = lambda: False
    ) -> None:
        """Waits until the app answers /health (its replica warmed up); raises what failed its
        deployment at once, and KeyboardInterrupt as soon as ``interrupted()``."""
        from ray import serve

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if interrupted():
                raise KeyboardInterrupt("interrupted while the replica started")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            app = serve.status().applications.get(_APP) if self._ray_started else None
            if app is not None and app.status == "DEPLOY_FAILED":
                raise RuntimeError(f"the Serve app failed to deploy: {app.message}")
            time.sleep(0.5)
        raise TimeoutError(f"the Serve app did not answer at {self.base_url} in {timeout_s}s")

    def wait_trainer(self, timeout_s: float = 300.0) -> bool:
        """Waits until the trainer's first heartbeat (it loaded its model and consumes the log);
        False, after `timeout_s` or without a trainer: serving does not need one, so callers
        go on (records wait in the stream)."""
        if self.trainer is None:
            return False
        key = trainer_beat_key(self.config.log.stream, self.config.trainer.group)
        client = connect(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(redis.RedisError):  # Redis restarting: ask again
                    if read_beat(client, key) is not None:
                        return True
                time.sleep(0.5)
            return False
        finally:
            client.close()

    def close(self) -> None:
        """Stops the trainer, Serve, Ray and redis-server, in that order; safe to repeat.

        A second Ctrl-C while stopping is ignored: interrupting the clean-up half-way is what
        would leave processes behind.
        """
        with _signals_ignored():
            self._close()

    def _close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.close()  # first: nothing is restarted while it is being stopped
            self.supervisor = None
        if self.trainer is not None and self.trainer.poll() is None:
            _stop_process_group(self.trainer)
        self.trainer = None
        if self._ray_started:
            import ray
            from ray import serve

            try:
                # Bounded: on a loaded machine Serve's graceful shutdown can retry for minutes;
                # ray.shutdown() below stops every process of the local cluster anyway.
                stopper = threading.Thread(target=serve.shutdown, daemon=True)
                stopper.start()
                stopper.join(_SERVE_SHUTDOWN_S)
                if stopper.is_alive():
                    print(
                        f"[osd] Serve did not shut down in {_SERVE_SHUTDOWN_S:.0f}s; "
                        "stopping Ray anyway",
                        flush=True,
                    )
            finally:
                ray.shutdown()
                self._ray_started = False
        if self.ingress is not None:
            self.ingress.close()
            self.ingress = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def _exit_status(code: int | None) -> str | None:
    if code is None:
        return None
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[Callable[[], bool]]:
    """Within the block SIGINT/SIGTERM only set a flag; the caller checks it at safe points."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    received: list[int] = []
    saved = {
        sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield lambda: bool(received)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _stop_process_group(process: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
