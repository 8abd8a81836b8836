"""A private local `redis-server`, and the Redis client settings the log buffer shares.

`LocalRedis` is the embedded default of docs/design.md ("one command on a fresh machine runs the
whole loop") and the fixture of the buffer's integration tests: it runs `redis-server` on a free
localhost port in its own data directory with the append-only file on, so that data survives
`restart()`. After `kill()` it keeps what reached the AOF: Redis's default `appendfsync everysec`
may hold back writes while a slow fsync runs (up to 2 s of them), so a crash can lose acknowledged
writes on a busy disk. `PROCESS_CRASH_SAFE_ARGS` trades that for the OS's flush: every
acknowledged write is in the file before the reply, and only a machine crash loses any. Tests that
kill the server and count every record use it.

`connect` builds the client that `LogWriter` and `LogReader` use: explicit socket timeouts and no
hidden retries inside redis-py, because both callers do their own backoff.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from osd.closing import Closeable
from osd.process import die_with_parent_preexec

# `extra_args` for a server whose process may be killed with nothing acknowledged lost: each
# write goes to the AOF before its reply and is never postponed behind a slow fsync (which
# `everysec` does, and which once lost a whole pushed batch in CI); the OS flushes the file.
PROCESS_CRASH_SAFE_ARGS = ("--appendfsync", "no")

__all__ = [
    "PROCESS_CRASH_SAFE_ARGS",
    "LocalRedis",
    "RedisServerError",
    "check_credentials",
    "connect",
    "redact_url",
]


class RedisServerError(RuntimeError):
    """The local redis-server did not start, or did not answer in time."""


def redact_url(url: str) -> str:
    """Returns `url` with any password replaced by `***`, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def connect(
    url: str, *, socket_timeout_s: float = 5.0, connect_timeout_s: float = 2.0
) -> redis.Redis:
    """Builds a client for `url` (``redis://[[user]:password@]host:port/db``) without connecting.

    redis-py's own retries are turned off: a call fails fast and the caller decides when to retry.
    """
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"not a Redis URL: {redact_url(url)!r}")
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def check_credentials(client: redis.Redis, url: str) -> bool:
    """PINGs Redis: True if it answered, False if it is unreachable (which callers tolerate).

    Raises:
        ValueError: Redis rejected the credentials in `url` (wrong or missing password).
    """
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise ValueError(
            f"Redis at {redact_url(url)} rejected the credentials in the URL: {exc}"
        ) from exc
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRedis(Closeable):
    """A `redis-server` child process on 127.0.0.1, with AOF on, in a temporary directory.

    Use as a context manager; `stop()` shuts it down cleanly and `restart()` brings it back on the
    same port and data directory. `kill()` sends SIGKILL, for fault tests.

    Args:
        password: if set, the server requires it (`--requirepass`) and `url` carries it.
        port: port to listen on; a free one is picked when None.
        data_dir: where the AOF and log live; a fresh temporary directory (removed on exit)
            when None.
        start_timeout_s: how long `start()` waits for the server to answer PING.
        executable: the redis-server binary, looked up on PATH.
        extra_args: more `--option value` arguments for redis-server.
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        port: int | None = None,
        data_dir: str | Path | None = None,
        start_timeout_s: float = 10.0,
        executable: str = "redis-server",
        extra_args: Sequence[str] = (),
    ) -> None:
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s}")
        found = shutil.which(executable)
        if found is None:
            raise FileNotFoundError(
                f"{executable!r} is not on PATH; install Redis (e.g. `apt-get install "
                "redis-server`) or point osd at an existing Redis with a URL"
            )
        self.executable = found
        self.password = password
        self._pick_port = port is None
        self.port = port if port is not None else _free_port()
        self._owns_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="osd-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "redis.log"
        self.start_timeout_s = start_timeout_s
        self.extra_args = list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port/0``."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or None."""
        return self._proc.pid if self.running and self._proc else None

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """How the last server process ended (negative: the signal); None while it runs."""
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, num_lines: int = 20) -> str:
        """The last lines the server wrote to its log."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log written)"
        return "\n".join(lines[-num_lines:])

    def start(self) -> LocalRedis:
        """Starts the server and waits until it answers PING.

        A picked port that turns out to be taken is replaced by another once or twice; a port given
        by the caller, or the port of a restart, is not.

        Raises:
            RedisServerError: it exited (e.g. the port is taken) or did not answer within
                start_timeout_s; the message has the end of its log.
        """
        if self.running:
            raise RedisServerError(f"redis-server already running on port {self.port}")
        for attempt in range(3):
            try:
                self._spawn_and_wait()
                self._pick_port = False
                return self
            except RedisServerError as exc:
                retry = self._pick_port and "Address already in use" in str(exc) and attempt < 2
                if not retry:
                    raise
                self.port = _free_port()
        raise AssertionError("unreachable")

    def _spawn_and_wait(self) -> None:
        args = [
            self.executable,
            *("--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)),
            *("--appendonly", "yes", "--save", "", "--daemonize", "no"),
            *(("--requirepass", self.password) if self.password else ()),
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent_preexec(),  # no orphaned server if the parent is killed
            )
        deadline = time.monotonic() + self.start_timeout_s
        client = connect(self.url, socket_timeout_s=1.0, connect_timeout_s=0.5)
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RedisServerError(
                        f"redis-server exited with code {self._proc.returncode} on port "
                        f"{self.port}; log tail:\n{self.log_tail()}"
                    )
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    # Another server on this port would answer too: only our pid counts, and
                    # only once it has loaded the AOF.
                    info = client.info()
                    if info.get("process_id") == self._proc.pid and not info.get("loading"):
                        return
                if time.monotonic() > deadline:
                    self._terminate(timeout_s=2.0)
                    raise RedisServerError(
                        f"redis-server on port {self.port} did not answer PING within "
                        f"{self.start_timeout_s} s; log tail:\n{self.log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Shuts the server down cleanly (SHUTDOWN flushes the AOF); terminates or kills it if
        it does not exit within `timeout_s`. Does nothing if it is not running."""
        if not self.running or self._proc is None:
            return
        client = connect(self.url, socket_timeout_s=timeout_s, connect_timeout_s=1.0)
        # redis-py treats the connection closing under SHUTDOWN as success.
        with contextlib.suppress(redis.RedisError):
            client.shutdown()
        client.close()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._terminate(timeout_s=2.0)

    def _terminate(self, timeout_s: float) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def kill(self) -> None:
        """Kills the server with SIGKILL (no shutdown, no final fsync), as a crash would."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()

    def restart(self) -> LocalRedis:
        """Stops the server if it runs, then starts it on the same port and data directory."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stops the server and removes the data directory if this object created it."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"LocalRedis(port={self.port}, {state}, data_dir={str(self.data_dir)!r})"
