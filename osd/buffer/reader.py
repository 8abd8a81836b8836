"""The trainer side of the log buffer: records read from a Redis stream through a consumer group.

Delivery is at least once. `read` hands out new entries (``XREADGROUP ... >``); the trainer
`ack`s them once they are used. Entries a consumer read but never acknowledged (it died) stay
pending in the group, and `claim_stale` takes them over after they sat idle long enough
(``XAUTOCLAIM``). Acks that fail because Redis is away are kept and sent again on the next call.

Entries that do not decode never stop consumption and are never returned. They are copied to the
dead-letter stream ``<stream>:dead`` with the error, then acknowledged:
- corrupt entries (bad magic, truncated, CRC mismatch, invalid fields, no ``r`` field) at once,
  since reading them again cannot help;
- entries of another schema version (`RecordVersionError`, e.g. written by newer replicas during
  a rolling upgrade) only once their delivery count reaches `max_deliveries`. Until then they stay
  pending, so a consumer that knows that version can claim them.

Connection errors never escape: the call waits out a capped exponential backoff and returns
nothing (`read`, `claim_stale`) or zero, so the trainer's loop simply calls again; `ack` never
waits (it keeps the ids and sends them once Redis is back). Rejected credentials are a
configuration error and raise `ValueError`, at construction or later.

An entry this reader acknowledged, or is still to acknowledge, is never handed out again:
`claim_stale` would otherwise take back entries whose acknowledgement is still waiting for Redis
to return, and a Redis that lost its last writes (with AOF `everysec`: after a crash of the
machine, or of the process while Redis was holding writes back behind a slow fsync) forgets
acknowledgements and deliveries. Such an entry is acknowledged again and
counted (`redelivered`); the reader remembers its last `remember_acks` acknowledged ids.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable
from functools import partial
from typing import Any, TypeVar

import redis

from osd.buffer.record import Record, RecordVersionError
from osd.buffer.redis_server import check_credentials, connect, redact_url
from osd.buffer.stream_info import ReaderMetrics, group_info, text

__all__ = ["LogReader", "ReaderMetrics"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_DEAD_MAXLEN = 10_000
_REMEMBER_ACKS = 65_536
# Errors that pass by themselves: an outage, or a full Redis (maxmemory) refusing a write.
_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.OutOfMemoryError)
_Entry = tuple[bytes, dict[bytes, bytes] | None]


class LogReader:
    """Reads `Record`s from the log stream as one consumer of a consumer group.

    Args:
        url: Redis URL, ``redis://[:password@]host:port/db``.
        stream: stream key.
        group: consumer group; created (with the stream) if missing.
        consumer: this consumer's name; ``<hostname>-<pid>`` by default.
        dead_stream: dead-letter stream key; ``<stream>:dead`` by default.
        max_deliveries: deliveries after which an entry of another schema version is
            dead-lettered.
        start_id: where a newly created group starts: "0" for the whole stream, "$" for new
            entries only.
        socket_timeout_s: bound on one Redis call; must exceed the `block_ms` given to `read`.
        backoff_initial_s: first wait after a connection error; doubles per failure.
        backoff_max_s: cap on that wait.
        remember_acks: how many of its latest acknowledged entry ids the reader remembers, to
            recognise them if Redis delivers them again.
        delete_acked: delete entries from the stream as they are acknowledged (a stream only
            this group reads, such as a trainer pool's per-adapter stream).

    Raises:
        ValueError: a bad argument, or Redis rejected the credentials. Redis being down at
            construction is not an error: the group is created on the first call that reaches it.
    """

    def __init__(
        self,
        url: str,
        stream: str = "osd:records",
        group: str = "trainer",
        consumer: str | None = None,
        *,
        dead_stream: str | None = None,
        max_deliveries: int = 3,
        start_id: str = "0",
        socket_timeout_s: float = 5.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        remember_acks: int = _REMEMBER_ACKS,
        delete_acked: bool = False,
    ) -> None:
        if not stream or not group:
            raise ValueError(f"stream and group must not be empty, got {stream!r}, {group!r}")
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {max_deliveries}")
        if remember_acks < 0:
            raise ValueError(f"remember_acks must be >= 0, got {remember_acks}")
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError(
                f"need 0 < backoff_initial_s <= backoff_max_s, got {backoff_initial_s}, "
                f"{backoff_max_s}"
            )
        self.url, self.stream, self.group = url, stream, group
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.dead_stream = dead_stream or f"{stream}:dead"
        self.max_deliveries, self.start_id = max_deliveries, start_id
        self.delete_acked = delete_acked
        self.socket_timeout_s = socket_timeout_s
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self._client = connect(url, socket_timeout_s=socket_timeout_s)
        self._backoff_s = 0.0
        self._retry_at = 0.0  # monotonic time before which acks are not sent (Redis failed)
        self._connected = True
        self._group_ready = False
        self._ack_backlog: list[str] = []
        self.last_ack_at = 0.0  # Unix time Redis last confirmed an acknowledgement (0: never)
        self._acked: OrderedDict[str, None] = OrderedDict()  # the latest acknowledged ids
        self._remember_acks = remember_acks
        self._counts = dict.fromkeys(
            ("read", "claimed", "acked", "dead_lettered", "redelivered"), 0
        )
        try:
            reachable = check_credentials(self._client, url)
        except ValueError:
            self._client.close()
            raise
        if reachable:
            self._ensure_group()
        else:
            self._connected = False
            _log.warning("Redis at %s is unreachable; will retry", redact_url(url))

    def read(self, count: int = 256, block_ms: int = 1000) -> list[tuple[str, Record]]:
        """Reads up to `count` new entries, waiting up to `block_ms` for the first.

        Args:
            count: most entries to return.
            block_ms: how long to wait when there are none; 0 returns at once.

        Returns:
            (entry_id, record) pairs in stream order; entries that did not decode are left out.
        """
        if count < 1 or block_ms < 0:
            raise ValueError(f"need count >= 1 and block_ms >= 0, got {count}, {block_ms}")
        if block_ms / 1e3 + 0.5 > self.socket_timeout_s:
            raise ValueError(
                f"block_ms {block_ms} must be at least 0.5 s below socket_timeout_s "
                f"{self.socket_timeout_s}"
            )
        self._flush_acks()
        response = self._call(partial(self._read_new, count, block_ms))
        entries: list[_Entry] = response[0][1] if response else []
        return self._decode(self._drop_known(entries), fresh=True)

    def claim_stale(
        self, min_idle_ms: int, count: int = 256, held: Container[str] = ()
    ) -> list[tuple[str, Record]]:
        """Takes over entries other consumers left pending for at least `min_idle_ms`.

        Args:
            min_idle_ms: how long an entry has been pending without delivery.
            count: about how many entries to take.
            held: ids this consumer holds already (read, not yet acknowledged): they are pending
                on it too, and left out without decoding; the scan goes on past them, so a
                consumer holding many cannot starve a dead one's entries.

        Returns:
            Up to about `count` (entry_id, record) pairs, now pending on this consumer.
        """
        if min_idle_ms < 0 or count < 1:
            raise ValueError(f"need min_idle_ms >= 0 and count >= 1, got {min_idle_ms}, {count}")
        self._flush_acks()
        entries: list[_Entry] = []
        cursor = "0-0"
        while len(entries) < count:
            response = self._call(
                partial(self._autoclaim, cursor, min_idle_ms, count - len(entries))
            )
            if response is None:
                break
            cursor = text(response[0])
            entries.extend(  # None: deleted (Redis 6)
                e for e in response[1] if e[0] is not None and text(e[0]) not in held
            )
            if cursor == "0-0":
                break
        entries = self._drop_known(entries)
        self._counts["claimed"] += len(entries)
        return self._decode(entries, fresh=False)

    def _drop_known(self, entries: list[_Entry]) -> list[_Entry]:
        """Leaves out entries acknowledged already or waiting to be; re-acks the former."""
        waiting = set(self._ack_backlog)
        out = []
        for entry in entries:
            entry_id = text(entry[0])
            if entry_id in waiting:
                self._counts["redelivered"] += 1
            elif entry_id in self._acked:
                self._counts["redelivered"] += 1
                self._ack_backlog.append(entry_id)  # Redis forgot the ack: send it again
            else:
                out.append(entry)
        return out

    def _read_new(self, count: int, block_ms: int) -> Any:
        return self._client.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms or None
        )

    def _autoclaim(self, cursor: str, min_idle_ms: int, count: int) -> Any:
        return self._client.xautoclaim(
            self.stream, self.group, self.consumer, min_idle_ms, cursor, count=count
        )

    def ack(self, ids: Iterable[str]) -> int:
        """Acknowledges processed entries; ids that cannot be sent now are retried later.

        Never waits: while Redis is away (within the backoff after a failure) the ids are kept
        without trying, so a trainer acknowledging after every step trains on at full speed.

        Returns:
            How many entries Redis acknowledged in this call (including earlier leftovers).
        """
        self._ack_backlog.extend(ids)
        return self._flush_acks()

    def trim_older_than(self, seconds: float, *, approximate: bool = False) -> int:
        """Deletes entries older than `seconds` by Redis's clock (``XTRIM MINID``).

        Stream ids start with the server's time in milliseconds, so this is retention by age.

        Returns:
            The number of entries deleted (0 if Redis cannot be reached).
        """
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        server_time = self._call(self._client.time)
        if server_time is None:
            return 0
        now_ms = server_time[0] * 1000 + server_time[1] // 1000
        min_id = f"{max(0, now_ms - int(seconds * 1000))}-0"
        deleted = self._call(
            lambda: self._client.xtrim(self.stream, minid=min_id, approximate=approximate)
        )
        return int(deleted or 0)

    @property
    def connected(self) -> bool:
        """Whether the last Redis call succeeded (asks Redis nothing)."""
        return self._connected

    def metrics(self) -> ReaderMetrics:
        """Stream length, group pending/lag and this reader's counters."""
        info = self._call(self._read_stream_info, wait=False) or {}
        return ReaderMetrics(
            stream_length=info.get("stream_length"),
            pending=info.get("pending"),
            last_delivered_id=info.get("last_delivered_id"),
            lag=info.get("lag"),
            dead_letters=info.get("dead_letters"),
            connected=self._connected,
            **self._counts,
        )

    def close(self) -> None:
        """Sends leftover acks (one attempt, even within a backoff) and closes the connection.

        Acks that still cannot be sent are logged: their entries stay pending in the group and
        will be delivered again to the next reader of the group.
        """
        self._retry_at = 0.0
        self._flush_acks()
        if self._ack_backlog:
            _log.warning("closing with %d unsent acknowledgements", len(self._ack_backlog))
        self._client.close()

    def _read_stream_info(self) -> dict[str, Any]:
        pipe = self._client.pipeline(transaction=False)
        pipe.xlen(self.stream)
        pipe.xinfo_groups(self.stream)
        pipe.xlen(self.dead_stream)
        length, groups, dead = pipe.execute()
        info = group_info(groups, self.group)
        if info is None:
            return {"stream_length": length, "dead_letters": dead}
        return {"stream_length": length, "dead_letters": dead, **dataclasses.asdict(info)}

    def _decode(self, entries: list[_Entry], *, fresh: bool) -> list[tuple[str, Record]]:
        """Decodes entries; dead-letters the corrupt ones and the over-delivered foreign ones."""
        out = []
        for raw_id, fields in entries:
            entry_id = text(raw_id)
            try:
                if not fields or b"r" not in fields:
                    raise ValueError(f"entry has no 'r' field: {sorted(fields or {})}")
                out.append((entry_id, Record.unpack(fields[b"r"])))
            except ValueError as exc:  # RecordVersionError is one
                deliveries = 1 if fresh else self._deliveries(entry_id)
                if not isinstance(exc, RecordVersionError) or deliveries >= self.max_deliveries:
                    self._dead_letter(entry_id, fields, exc, deliveries)
        self._counts["read"] += len(out)
        return out

    def _deliveries(self, entry_id: str) -> int:
        rows = self._call(
            lambda: self._client.xpending_range(self.stream, self.group, entry_id, entry_id, 1)
        )
        return int(rows[0]["times_delivered"]) if rows else 0

    def _dead_letter(
        self, entry_id: str, fields: dict[bytes, bytes] | None, exc: ValueError, deliveries: int
    ) -> None:
        """Copies the entry and its error to the dead-letter stream and acks it, atomically."""
        _log.warning("log reader: entry %s does not decode (%s); dead-lettered", entry_id, exc)
        error = f"{type(exc).__name__}: {exc}"[:1000]
        raw = (fields or {}).get(b"r", b"")

        def move() -> bool:
            pipe = self._client.pipeline(transaction=True)
            pipe.xadd(
                self.dead_stream,
                {
                    "id": entry_id,
                    "error": error,
                    "consumer": self.consumer,
                    "deliveries": deliveries,
                    "r": raw,
                },
                maxlen=_DEAD_MAXLEN,
                approximate=True,
            )
            pipe.xack(self.stream, self.group, entry_id)
            if self.delete_acked:
                pipe.xdel(self.stream, entry_id)
            pipe.execute()
            return True

        if self._call(move):
            self._counts["dead_lettered"] += 1

    def _flush_acks(self) -> int:
        if not self._ack_backlog or time.monotonic() < self._retry_at:
            return 0
        backlog = list(self._ack_backlog)
        acked = self._call(lambda: self._send_acks(backlog), wait=False)
        if acked is None:
            return 0
        del self._ack_backlog[: len(backlog)]
        self._counts["acked"] += int(acked)
        self.last_ack_at = time.time()
        for entry_id in backlog:
            self._acked[entry_id] = None
            self._acked.move_to_end(entry_id)
        while len(self._acked) > self._remember_acks:
            self._acked.popitem(last=False)
        return int(acked)

    def _send_acks(self, ids: list[str]) -> int:
        if not self.delete_acked:
            return int(self._client.xack(self.stream, self.group, *ids))
        pipe = self._client.pipeline(transaction=True)
        pipe.xack(self.stream, self.group, *ids)
        pipe.xdel(self.stream, *ids)
        return int(pipe.execute()[0])

    def _ensure_group(self) -> None:
        try:
            self._client.xgroup_create(self.stream, self.group, id=self.start_id, mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _call(self, fn: Callable[[], _T], *, wait: bool = True) -> _T | None:
        """Runs one Redis call, creating the group first if needed (again if Redis lost it).

        Connection errors, and writes refused by a full Redis (maxmemory), become None after a
        backoff wait (with `wait`; else the wait is only noted, in `_retry_at`); rejected
        credentials a ValueError.
        """
        try:
            if not self._group_ready:
                self._ensure_group()
            try:
                result = fn()
            except redis.ResponseError as exc:
                if not any(lost in str(exc) for lost in ("NOGROUP", "no such key")):
                    raise
                self._ensure_group()  # the stream or group is gone, e.g. Redis lost its data
                result = fn()
        except redis.AuthenticationError as exc:
            raise ValueError(
                f"Redis at {redact_url(self.url)} rejected the credentials in the URL: {exc}"
            ) from exc
        except _TRANSIENT as exc:
            self._on_connection_error(exc, wait)
            return None
        if not self._connected:
            _log.info("log reader: Redis at %s is back", redact_url(self.url))
        self._connected, self._backoff_s, self._retry_at = True, 0.0, 0.0
        return result

    def _on_connection_error(self, exc: Exception, wait: bool) -> None:
        if self._connected:
            _log.warning(
                "log reader: Redis at %s failed (%s); backing off", redact_url(self.url), exc
            )
        self._connected = False
        self._backoff_s = min(self.backoff_max_s, max(self.backoff_initial_s, 2 * self._backoff_s))
        self._retry_at = time.monotonic() + self._backoff_s
        if wait:
            time.sleep(self._backoff_s)
