"""The trainer's heartbeat: a thread that writes `osd.buffer.loop_status.TrainerBeat` to Redis.

A thread of its own, so a long training round does not look like a dead trainer; the beat
also carries when the training loop last came round, so a stuck loop shows too. Redis being
away costs beats, never the trainer: errors are logged once and the thread carries on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import redis

from osd.buffer.loop_status import TrainerBeat, trainer_beat_key, write_beat
from osd.buffer.redis_server import connect
from osd.closing import Closeable

__all__ = ["Heartbeat"]

_log = logging.getLogger(__name__)


class Heartbeat(Closeable):
    """Writes a beat every ``interval_s`` until closed.

    Args:
        url: the Redis holding the log stream.
        stream, group: the stream and consumer group the trainer consumes.
        progress: returns (loop_at, last_ack_at, rounds, judging) from the trainer, read at
            each beat.
        interval_s: seconds between beats.
        active: whether to beat now (a trainer pool: only its dispatcher beats for the log's
            group, so one worker's figures are shown, not whichever wrote last).
    """

    def __init__(
        self,
        url: str,
        stream: str,
        group: str,
        progress: Callable[[], tuple[float, float, int, int]],
        *,
        interval_s: float = 5.0,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.key = trainer_beat_key(stream, group)
        self.interval_s = interval_s
        self._progress, self._active = progress, active
        self._client = connect(url, socket_timeout_s=min(5.0, interval_s))
        self._started_at = time.time()
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="trainer-heartbeat", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def beat(self) -> bool:
        """Writes one beat now (if active); False (logged once per outage) when Redis did not
        take it."""
        if not self._active():
            return True
        loop_at, last_ack_at, rounds, judging = self._progress()
        beat = TrainerBeat(
            os.getpid(), time.time(), loop_at, last_ack_at, rounds, self._started_at, judging
        )
        try:
            write_beat(self._client, self.key, beat)
        except redis.RedisError as exc:
            if not self._failing:
                _log.warning("heartbeat: Redis did not take it (%s); retrying", exc)
            self._failing = True
            return False
        self._failing = False
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5)
        self._client.close()
