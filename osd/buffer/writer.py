"""The replica side of the log buffer: records go to a Redis stream without ever blocking decoding.

docs/design.md, "Never block serving": `LogWriter.log` puts the record into a bounded in-memory
queue and returns (a few microseconds); a daemon thread packs queued records and sends them in
batches, one pipeline of ``XADD <stream> MAXLEN ~ <maxlen> * r <bytes>`` per batch. When a round
trip fails (Redis slow or down) the thread retries the batch up to `max_attempts` times with capped
exponential backoff, then drops it (reason redis_error); meanwhile the queue fills and `log` drops
what does not fit (reason queue_full), so memory stays bounded. The backoff is kept across batches
until a round trip succeeds, so writing resumes by itself within `backoff_max_s` of Redis's return.

Bound: at most `maxlen` entries and, with `max_bytes`, what fits in that much Redis memory by the
measured record sizes (`osd.buffer.stream_budget`). Entries a full Redis refuses are redis_error
drops, and the writer then trims the stream by a quarter: the log gives way, never adapter versions.

Accounting: every `log` call of a record that was not opted out counts once in `logged` and ends
as exactly one of `written` (Redis confirmed it) or `dropped`, by reason: queue_full, redis_error,
encode_error, closed (logged after `close`, or unsent at its deadline) or internal_error (not
expected). After `close`, written + dropped == logged. Delivery is at least once: a batch cut off
by a dropped connection may have been stored before it is retried.

Opt-out: a request that opted out of logging is passed with ``log(record, opt_out=True)`` (or not
passed at all). It is counted in `opted_out`, never enters the queue and is never packed or sent,
and it is not part of `logged`. Callers should skip building records they will not log; the flag
keeps the decision in one visible place and in the metrics.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from osd.buffer.record import Record
from osd.buffer.redis_server import check_credentials, connect, redact_url
from osd.buffer.stream_budget import StreamBudget
from osd.closing import Closeable

if TYPE_CHECKING:
    from osd.config import LogConfig

__all__ = ["DROP_REASONS", "LogWriter", "WriterMetrics"]

_log = logging.getLogger(__name__)

DROP_REASONS: tuple[str, ...] = (
    "queue_full",
    "redis_error",
    "encode_error",
    "closed",
    "internal_error",
)
_EWMA_ALPHA = 0.1


@dataclass(frozen=True)
class WriterMetrics:
    """A snapshot of a `LogWriter`'s counters.

    Attributes:
        logged: records passed to `log` without opt-out.
        written: records Redis confirmed.
        dropped: records given up on; the sum of `dropped_by_reason`.
        dropped_by_reason: drops per reason in DROP_REASONS.
        opted_out: records passed with opt_out=True (never written, not in `logged`).
        queue_depth: records waiting in the queue now.
        connected: whether the last round trip to Redis succeeded.
        failed_round_trips: pipelines that failed with a connection or Redis error.
        last_write_ms: duration of the last successful pipeline.
        ewma_write_ms: exponentially weighted mean of that duration (alpha 0.1).
        max_write_ms: the longest successful pipeline.
        trim_len: the ``MAXLEN ~`` sent now (`maxlen`, or less by `max_bytes`).
        mean_record_bytes: moving average of the packed records' size.
    """

    logged: int
    written: int
    dropped: int
    dropped_by_reason: Mapping[str, int]
    opted_out: int
    queue_depth: int
    connected: bool
    failed_round_trips: int
    last_write_ms: float
    ewma_write_ms: float
    max_write_ms: float
    trim_len: int
    mean_record_bytes: float


def _check_arguments(stream: str, counts: dict[str, int], durations: dict[str, float]) -> None:
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for name, seconds in durations.items():
        if not seconds > 0:
            raise ValueError(f"{name} must be positive, got {seconds}")
    if not stream:
        raise ValueError("stream must not be empty")


class LogWriter(Closeable):
    """Writes `Record`s to a Redis stream from a background thread; `log` never blocks or raises.

    Args:
        url: Redis URL, ``redis://[:password@]host:port/db``.
        stream: stream key.
        maxlen: approximate cap on the stream length (``MAXLEN ~``; Redis trims whole
            macro-nodes, so the length can exceed it by up to about 100 entries by default).
        max_bytes: Redis memory the stream may take, turned into a smaller cap on its length
            from the measured record sizes; 0: `maxlen` alone.
        queue_size: records held in memory while Redis is slow or down; more are dropped.
        batch_size: records per pipeline at most.
        flush_interval_s: how long the thread waits for a first record before checking for close.
        socket_timeout_s: bound on one Redis round trip.
        backoff_initial_s: first wait after a failed round trip; doubles per failure.
        backoff_max_s: cap on that wait.
        max_attempts: round trips tried per batch before its records are dropped (redis_error).

    Raises:
        ValueError: a bad argument, or Redis rejected the credentials. Redis being down at
            construction is not an error: the writer starts and connects when it can.
    """

    def __init__(
        self,
        url: str,
        stream: str = "osd:records",
        *,
        maxlen: int = 100_000,
        max_bytes: int = 0,
        queue_size: int = 10_000,
        batch_size: int = 64,
        flush_interval_s: float = 0.05,
        socket_timeout_s: float = 1.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        max_attempts: int = 3,
    ) -> None:
        _check_arguments(
            stream,
            counts={
                "maxlen": maxlen,
                "queue_size": queue_size,
                "batch_size": batch_size,
                "max_attempts": max_attempts,
            },
            durations={
                "flush_interval_s": flush_interval_s,
                "socket_timeout_s": socket_timeout_s,
                "backoff_initial_s": backoff_initial_s,
                "backoff_max_s": backoff_max_s,
            },
        )
        self.url, self.stream, self.maxlen = url, stream, maxlen
        self.budget = StreamBudget(maxlen, max_bytes)
        self.batch_size, self.flush_interval_s = batch_size, flush_interval_s
        self.socket_timeout_s, self.max_attempts = socket_timeout_s, max_attempts
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self._client = connect(
            url, socket_timeout_s=socket_timeout_s, connect_timeout_s=socket_timeout_s
        )
        try:
            reachable = check_credentials(self._client, url)
        except ValueError:
            self._client.close()
            raise
        if not reachable:
            _log.warning("Redis at %s is unreachable; records queue until it is", redact_url(url))
        self._queue: queue.Queue[Record] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._logged = self._written = self._opted_out = self._failed_round_trips = 0
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._connected = reachable
        self._last_ms = self._ewma_ms = self._max_ms = 0.0
        self._backoff_s = 0.0
        self._closed = False
        self._closing = threading.Event()
        self._deadline = float("inf")
        self._thread = threading.Thread(target=self._run, name="osd-log-writer", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, url: str, log: LogConfig) -> LogWriter:
        """A writer as the config's `log` section says (stream, maxlen, max_bytes, queue_size)."""
        return cls(
            url, log.stream, maxlen=log.maxlen, max_bytes=log.max_bytes, queue_size=log.queue_size
        )

    def log(self, record: Record, *, opt_out: bool = False) -> bool:
        """Queues `record` for writing and returns at once; never raises.

        Args:
            record: the finished request's record.
            opt_out: the request opted out of logging: count it, never write it.

        Returns:
            True if the record was queued; False if opted out or dropped (counted).
        """
        reason = "closed"
        try:
            with self._lock:
                if opt_out:
                    self._opted_out += 1
                    return False
                self._logged += 1
                if not self._closed:
                    self._queue.put_nowait(record)
                    return True
        except queue.Full:
            reason = "queue_full"
        except Exception:  # not expected; never let logging break a request, keep books balanced
            reason = "internal_error"
        self._count_drops(reason, 1)
        return False

    def metrics(self) -> WriterMetrics:
        """A consistent snapshot of the counters."""
        with self._lock:
            return WriterMetrics(
                logged=self._logged,
                written=self._written,
                dropped=sum(self._dropped.values()),
                dropped_by_reason=dict(self._dropped),
                opted_out=self._opted_out,
                queue_depth=self._queue.qsize(),
                connected=self._connected,
                failed_round_trips=self._failed_round_trips,
                last_write_ms=self._last_ms,
                ewma_write_ms=self._ewma_ms,
                max_write_ms=self._max_ms,
                trim_len=self.budget.trim_len,
                mean_record_bytes=self.budget.mean_payload_bytes,
            )

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Waits until every queued record is written or dropped; True if that happened in time."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 5.0) -> WriterMetrics:
        """Stops accepting records, writes what it can within `timeout_s`, stops the thread.

        Records still unsent at the deadline are dropped as "closed". Idempotent.
        """
        with self._lock:
            already, self._closed = self._closed, True
        if not already:
            self._deadline = time.monotonic() + timeout_s
            self._closing.set()
            # One more round trip may be in flight at the deadline; it is bounded by the timeouts.
            self._thread.join(timeout_s + 2 * self.socket_timeout_s + 1.0)
            if self._thread.is_alive():
                _log.warning("log writer thread still busy after close(%s)", timeout_s)
            self._drop_queued("closed")
            self._client.close()
        return self.metrics()

    def _run(self) -> None:
        while not (self._closing.is_set() and self._queue.empty()):
            batch = self._take_batch()
            if not batch:
                continue
            try:
                if time.monotonic() > self._deadline:
                    self._count_drops("closed", len(batch))
                else:
                    self._send(self._encode(batch))
            except Exception:  # the thread must survive anything; count and carry on
                _log.exception("log writer: unexpected error; %d records dropped", len(batch))
                self._count_drops("redis_error", len(batch))
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _take_batch(self) -> list[Record]:
        try:
            batch = [self._queue.get(timeout=self.flush_interval_s)]
        except queue.Empty:
            return []
        while len(batch) < self.batch_size:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _encode(self, batch: list[Record]) -> list[bytes]:
        payloads = []
        for record in batch:
            try:
                payloads.append(record.pack())
                self.budget.observe(len(payloads[-1]))
            except Exception:
                _log.exception("log writer: could not pack a record; dropped")
                self._count_drops("encode_error", 1)
        return payloads

    def _send(self, payloads: list[bytes]) -> None:
        """Sends one batch, retrying round trips with backoff; counts every record's outcome."""
        for attempt in range(1, self.max_attempts + 1):
            if not payloads:
                return
            started = time.perf_counter()
            try:
                pipe = self._client.pipeline(transaction=False)
                for data in payloads:
                    pipe.xadd(
                        self.stream, {"r": data}, maxlen=self.budget.trim_len, approximate=True
                    )
                results = pipe.execute(raise_on_error=False)
            except redis.RedisError as exc:
                self._on_failure(exc)
                if attempt == self.max_attempts or not self._sleep_backoff():
                    break
                continue
            self._on_success(results, (time.perf_counter() - started) * 1e3)
            return
        self._count_drops("redis_error", len(payloads))

    def _on_success(self, results: list[object], elapsed_ms: float) -> None:
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:  # e.g. OOM: the server refused these entries; retrying would not help
            _log.warning("log writer: Redis refused %d entries: %s", len(errors), errors[0])
        if any(isinstance(e, redis.exceptions.OutOfMemoryError) for e in errors):
            self._give_way()
        elif not errors:
            self.budget.on_accepted()
        with self._lock:
            if not self._connected:
                _log.info("log writer: Redis at %s is back", redact_url(self.url))
            self._connected = True
            self._backoff_s = 0.0
            self._written += len(results) - len(errors)
            self._dropped["redis_error"] += len(errors)
            self._last_ms = elapsed_ms
            self._max_ms = max(self._max_ms, elapsed_ms)
            ewma = self._ewma_ms or elapsed_ms
            self._ewma_ms = ewma + _EWMA_ALPHA * (elapsed_ms - ewma)

    def _give_way(self) -> None:
        """Redis is at its maxmemory: trims the stream by a quarter (XTRIM is allowed then)."""
        try:
            self.budget.on_full(int(self._client.xlen(self.stream)))
            trimmed = self._client.xtrim(self.stream, maxlen=self.budget.trim_len, approximate=True)
        except redis.RedisError as exc:
            _log.warning("log writer: could not trim %s to make room: %s", self.stream, exc)
            return
        _log.warning("log writer: Redis is full; trimmed %s entries of %s", trimmed, self.stream)

    def _on_failure(self, exc: redis.RedisError) -> None:
        with self._lock:
            if self._connected:
                _log.warning(
                    "log writer: Redis at %s failed (%s); retrying with backoff",
                    redact_url(self.url),
                    exc,
                )
            self._connected = False
            self._failed_round_trips += 1
            self._backoff_s = min(
                self.backoff_max_s, max(self.backoff_initial_s, 2 * self._backoff_s)
            )

    def _sleep_backoff(self) -> bool:
        """Waits out the backoff; False if the close deadline passes first (stop retrying).

        Before close the wait ends early when close is called, for one last prompt attempt.
        """
        wait = min(self._backoff_s, self._deadline - time.monotonic())
        if wait <= 0:
            return False
        if self._closing.is_set():
            time.sleep(wait)
        else:
            self._closing.wait(wait)
        return time.monotonic() < self._deadline

    def _count_drops(self, reason: str, count: int) -> None:
        with self._lock:
            self._dropped[reason] += count

    def _drop_queued(self, reason: str) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self._count_drops(reason, 1)
            self._queue.task_done()
