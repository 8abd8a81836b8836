"""Keeps the local stack's child processes running: restart what dies, give up on what keeps dying.

`osd up` and `osd demo` start a private redis-server and a trainer process beside Ray. Either
can die (killed for memory, a bug, an operator's ``kill``); the loop then stops while serving
goes on. `Supervisor` checks them every second and restarts a dead one after a short backoff
(1, 2, 4 ... 30 s), with a log line and a counter each time. A part that died more than
``max_restarts`` times within ``window_s`` is reported as failed and left alone: restarting a
process that cannot run only hides why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from osd.closing import Closeable
from osd.process import mark_long_lived

__all__ = ["Supervised", "Supervisor"]

logger = logging.getLogger(__name__)


@dataclass
class Supervised:
    """One child process the supervisor watches.

    Attributes:
        name: what the log lines call it.
        exit_status: None while it runs, else a few words on how it ended (e.g. "exit code -9").
        restart: starts it again (raises if that fails: counted as another death).
        hint: where to look when it keeps dying (a log file).
    """

    name: str
    exit_status: Callable[[], str | None]
    restart: Callable[[], object]
    hint: str = ""
    restarts: int = 0
    state: str = "running"  # running, restarting, failed
    last_exit: str = ""
    deaths: deque[float] = field(default_factory=deque)
    retry_at: float = 0.0


class Supervisor(Closeable):
    """Watches ``parts`` from a thread; ``close()`` stops watching (call it before stopping them).

    Args:
        parts: the processes to keep running.
        interval_s: seconds between checks.
        max_restarts: deaths within ``window_s`` after which a part is left failed.
        window_s: the window those deaths are counted in.
        say: where the one-line reports go (the console of ``osd up``).
    """

    def __init__(
        self,
        parts: list[Supervised],
        *,
        interval_s: float = 1.0,
        max_restarts: int = 5,
        window_s: float = 300.0,
        say: Callable[[str], None] = print,
    ) -> None:
        if max_restarts < 0 or window_s <= 0 or interval_s <= 0:
            raise ValueError("need max_restarts >= 0, window_s > 0 and interval_s > 0")
        self.parts = {part.name: part for part in parts}
        self.interval_s, self.max_restarts, self.window_s = interval_s, max_restarts, window_s
        self._say = say
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle = threading.Event()  # set once the thread stopped checking
        self._thread = threading.Thread(target=self._run, name="stack-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops supervising; returns once no restart is under way."""
        self._stop.set()
        if self._thread.is_alive():
            self._idle.wait(timeout=60)

    def status(self) -> dict[str, dict[str, Any]]:
        """Per part: ``state`` (running, restarting, failed), ``restarts``, ``last_exit``."""
        with self._lock:
            return {
                name: {"state": p.state, "restarts": p.restarts, "last_exit": p.last_exit}
                for name, p in self.parts.items()
            }

    def check(self, now: float | None = None) -> None:
        """One round: notes every death, restarts what is due (the thread calls this)."""
        now = time.monotonic() if now is None else now
        for part in self.parts.values():
            if self._stop.is_set():
                return
            if part.state == "failed":
                continue
            if part.state == "running":
                ended = part.exit_status()
                if ended is None:
                    continue
                self._died(part, ended, now)
            if part.state == "restarting" and now >= part.retry_at:
                self._restart(part, now)

    def _died(self, part: Supervised, how: str, now: float) -> None:
        part.deaths.append(now)
        while part.deaths and part.deaths[0] < now - self.window_s:
            part.deaths.popleft()
        with self._lock:
            part.last_exit = how
            if len(part.deaths) > self.max_restarts:
                part.state = "failed"
            else:
                part.state = "restarting"
                part.retry_at = now + min(30.0, 2.0 ** (len(part.deaths) - 1))
        if part.state == "failed":
            self._say(
                f"[osd] {part.name} died {len(part.deaths)} times in {self.window_s:.0f} s "
                f"(last: {how}); not restarting it{f': see {part.hint}' if part.hint else ''}"
            )
        else:
            wait = part.retry_at - now
            self._say(f"[osd] {part.name} died ({how}); restarting it in {wait:.0f} s")

    def _restart(self, part: Supervised, now: float) -> None:
        try:
            part.restart()
        except Exception as exc:  # noqa: BLE001 - a failed start is one more death
            self._died(part, f"restart failed: {exc}", now)
            return
        with self._lock:
            part.restarts += 1
            part.state = "running"
        self._say(f"[osd] {part.name} restarted (restart {part.restarts})")

    def _run(self) -> None:
        # What this thread restarts must die with the process, even by SIGKILL (no orphaned
        # trainer or redis-server); Linux ties that to the thread that started the child, so
        # the thread never returns: after close() it waits for the process to end.
        mark_long_lived()
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - supervision must outlive any surprise
                logger.exception("stack supervisor")
        self._idle.set()
        threading.Event().wait()
