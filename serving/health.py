"""Whether the loop around a replica works: the log buffer, the adapter store, the trainer.

A replica serves as long as its models do; the loop that makes it faster needs more: records
reaching Redis, a trainer consuming them, published adapter versions reaching the replica.
`LoopHealth` probes each of those from a thread of its own every few seconds (never on the
decode path) and keeps the last answer, which ``/health`` and ``/ready`` return and the
``osd_loop_*`` gauges export. A part is ``ok``, ``degraded`` (with a one-line problem), or
``off`` (not configured: no log buffer, no store); the loop is ``degraded`` if any part is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from osd.adapters.codec import AdapterStore
from osd.buffer.loop_status import read_beat, read_pool_status, trainer_beat_key
from osd.buffer.redis_server import connect, redact_url
from osd.buffer.stream_info import read_group_info
from osd.versions.errors import StoreError
from serving.adapter_slots import AdapterSlots
from serving.metrics import ReplicaMetrics

__all__ = ["HealthLimits", "LoopHealth", "PARTS"]

logger = logging.getLogger(__name__)

PARTS = ("log_buffer", "adapter_store", "trainer", "adapters")


@dataclass(frozen=True)
class HealthLimits:
    """When a part counts as degraded.

    Attributes:
        trainer_silent_s: the trainer's heartbeat (every 5 s) is older than this.
        trainer_stuck_s: its training loop has not come round for this long.
        ack_stale_s: records wait for the trainer and it acknowledged none for this long.
        max_lag: more records than this were never delivered to the trainer's group.
        drop_window_s: the log writer dropped a record within this many seconds.
        behind_s: a served adapter version differs from the published one for this long.
    """

    trainer_silent_s: float = 30.0
    trainer_stuck_s: float = 600.0
    ack_stale_s: float = 300.0
    max_lag: int = 10_000
    drop_window_s: float = 60.0
    behind_s: float = 60.0


class LoopHealth:
    """Probes the loop every ``interval_s`` and keeps the last report.

    Args:
        slots: the replica's adapter slots (which versions it serves).
        metrics: the replica's metrics (the probe sets its gauges).
        log_writer: the replica's log writer (None: it does not log).
        redis_url: the Redis of the log stream ("" when there is none).
        store: the adapter store the replica follows (None: no store).
        stream, group: the log stream and the trainer's consumer group.
        refused: (adapter, version) pairs the replica refused to load (the watcher's set).
        limits: the thresholds.
        interval_s: seconds between probes.
        clock: Unix time (tests move it).
    """

    def __init__(
        self,
        slots: AdapterSlots,
        metrics: ReplicaMetrics,
        *,
        log_writer: Any = None,
        redis_url: str = "",
        store: AdapterStore | None = None,
        stream: str = "osd:records",
        group: str = "trainer",
        refused: Callable[[], set[tuple[str, int]]] = set,
        limits: HealthLimits | None = None,
        interval_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.slots, self.metrics, self.log_writer = slots, metrics, log_writer
        self.store, self.limits = store, limits or HealthLimits()
        self.redis_url, self.stream, self.group = redis_url, stream, group
        self.interval_s, self.clock, self._refused = interval_s, clock, refused
        self._client = connect(redis_url, socket_timeout_s=2.0) if redis_url else None
        self._drops: deque[tuple[float, int]] = deque()  # (time, writer's dropped count)
        self._behind_since: dict[str, float] = {}
        self._report: dict[str, Any] = {"status": "starting", "checks": {}, "problems": []}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loop-health", daemon=True)

    def start(self) -> LoopHealth:
        self.probe()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._client is not None:
            self._client.close()

    def report(self) -> dict[str, Any]:
        """The last probe's report: ``status``, ``checks`` per part, ``problems`` (one line
        each) and ``checked_at``."""
        with self._lock:
            return self._report

    def probe(self) -> dict[str, Any]:
        """Checks every part now, updates the gauges, and returns the report."""
        now = self.clock()
        # One PING first: with Redis away, the checks that need it say so at once instead of
        # each waiting out its own timeout (the store's is 30 s), which held the report back.
        unreachable = self._ping()
        checks = {
            "log_buffer": self._log_buffer(now, unreachable),
            "adapter_store": self._adapter_store(unreachable),
            "trainer": self._trainer(now, unreachable),
        }
        checks["adapters"] = self._adapters(now, checks["adapter_store"])
        problems = [f"{part}: {c['problem']}" for part, c in checks.items() if "problem" in c]
        report = {
            "status": "degraded" if problems else "ok",
            "checks": checks,
            "problems": problems,
            "checked_at": now,
        }
        self._export(checks)
        with self._lock:
            changed = report["problems"] != self._report["problems"]
            self._report = report
        if changed:
            logger.warning("loop %s: %s", report["status"], "; ".join(problems) or "all parts ok")
        return report

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.probe()
            except Exception:  # noqa: BLE001 - the probe must outlive any surprise
                logger.exception("loop health probe failed")

    def _ping(self) -> str:
        """ "" if Redis answers, else why not."""
        if self._client is None:
            return "no Redis configured"
        try:
            self._client.ping()
        except redis.RedisError as exc:
            return f"Redis at {redact_url(self.redis_url)} unreachable ({type(exc).__name__})"
        return ""

    def _log_buffer(self, now: float, unreachable: str) -> dict[str, Any]:
        writer = self.log_writer
        if writer is None:
            return {"status": "off"}
        m = writer.metrics()
        self._drops.append((now, m.dropped))
        while len(self._drops) > 1 and self._drops[1][0] <= now - self.limits.drop_window_s:
            self._drops.popleft()
        recent = m.dropped - self._drops[0][1]
        check: dict[str, Any] = {
            "status": "ok",
            "reachable": not unreachable,
            "connected": m.connected,
            "queue_depth": m.queue_depth,
            "written": m.written,
            "dropped": m.dropped,
            "dropped_recently": recent,
        }
        if unreachable or not m.connected:
            check["problem"] = (unreachable or "writes fail") + f"; {m.queue_depth} records queued"
        elif recent:
            window = self.limits.drop_window_s
            check["problem"] = f"{recent} records dropped in the last {window:.0f} s"
        return _graded(check)

    def _adapter_store(self, unreachable: str) -> dict[str, Any]:
        if self.store is None:
            return {"status": "off"}
        if unreachable and getattr(self.store, "url", None) == self.redis_url:
            return _broken(f"unreachable ({unreachable})")
        try:
            pointers = {name: self.store.current(name) for name in self.slots.adapters}
        except StoreError as exc:
            return _broken(f"unreachable ({exc})")
        return {"status": "ok", "published": pointers}

    def _trainer(self, now: float, unreachable: str) -> dict[str, Any]:
        if self._client is None:
            return {"status": "off"}
        if unreachable:
            return _broken(f"cannot ask Redis ({unreachable})")
        limits = self.limits
        try:
            beat = read_beat(self._client, trainer_beat_key(self.stream, self.group))
            group = self._group_info()
        except redis.RedisError as exc:
            return _broken(f"cannot ask Redis ({type(exc).__name__})")
        check: dict[str, Any] = {"status": "ok", **group}
        workers = self._pool_workers()
        if workers:
            check["workers"] = workers
        if beat is None:
            check["problem"] = "no trainer has reported on this stream"
            return _graded(check)
        # Records the trainer holds to judge on stay pending by design (not waiting for it).
        judging = min(beat.judging, group.get("pending") or 0)
        waiting = (group.get("lag") or 0) + (group.get("pending") or 0) - judging
        last_ack_age = now - beat.last_ack_at if beat.last_ack_at else None
        check.update(
            pid=beat.pid,
            rounds=beat.rounds,
            judging=beat.judging,
            heartbeat_age_s=round(now - beat.alive_at, 1),
            loop_age_s=round(now - beat.loop_at, 1),
            last_ack_age_s=None if last_ack_age is None else round(last_ack_age, 1),
        )
        if now - beat.alive_at > limits.trainer_silent_s:
            check["problem"] = f"no heartbeat for {now - beat.alive_at:.0f} s"
        elif now - beat.loop_at > limits.trainer_stuck_s:
            check["problem"] = f"training loop stuck for {now - beat.loop_at:.0f} s"
        elif (group.get("lag") or 0) > limits.max_lag:
            check["problem"] = f"{group['lag']} records not yet delivered (behind)"
        elif waiting and now - max(beat.last_ack_at, beat.started_at) > limits.ack_stale_s:
            since = now - max(beat.last_ack_at, beat.started_at)
            check["problem"] = f"{waiting} records waiting, none acknowledged for {since:.0f} s"
        return _graded(check)

    def _pool_workers(self) -> list[dict[str, Any]]:
        """A trainer pool's workers (`trainer.pool`): each one's adapters and how far behind
        their streams are; empty for a single trainer."""
        assert self._client is not None
        try:
            statuses = read_pool_status(
                self._client, self.stream, self.group, 3 * self.limits.trainer_silent_s
            )
        except redis.RedisError:  # e.g. an ACL without the pool's key: the beat still tells
            return []
        return [
            {
                "worker": s.get("worker"),
                "pid": s.get("pid"),
                "adapters": s.get("adapters", []),
                "dispatching": bool(s.get("dispatching")),
                "lag": sum((v.get("lag") or 0) for v in s.get("streams", {}).values()),
                "pending": sum((v.get("pending") or 0) for v in s.get("streams", {}).values()),
                "report_age_s": round(time.time() - float(s.get("at", 0)), 1),
            }
            for s in statuses
        ]

    def _group_info(self) -> dict[str, Any]:
        assert self._client is not None
        info = read_group_info(self._client, self.stream, self.group)
        if info is None:  # no group yet (a trainer creates it): lag unknown, nothing pending
            return {"lag": None, "pending": 0}
        return {"lag": info.lag, "pending": info.pending}

    def _adapters(self, now: float, store: dict[str, Any]) -> dict[str, Any]:
        published = store.get("published")
        if published is None:
            return {"status": "off" if store["status"] == "off" else "ok"}
        slots, refused, behind = self.slots, self._refused(), {}
        for name, version in published.items():
            serving = slots.current(name)
            if version is None or version == serving:
                self._behind_since.pop(name, None)
                continue
            since = self._behind_since.setdefault(name, now)
            behind[name] = {
                "serving": serving,
                "published": version,
                "for_s": round(now - since, 1),
                "refused": (name, version) in refused,
            }
        served = {name: slots.current(name) for name in published}
        check: dict[str, Any] = {"status": "ok", "serving": served}
        stale = [n for n, b in behind.items() if b["refused"] or b["for_s"] > self.limits.behind_s]
        if behind:
            check["behind"] = behind
        if stale:
            check["problem"] = ", ".join(
                f"{n} serves v{behind[n]['serving']}, published v{behind[n]['published']}"
                + (" (refused)" if behind[n]["refused"] else f" for {behind[n]['for_s']:.0f} s")
                for n in stale
            )
        return _graded(check)

    def _export(self, checks: dict[str, dict[str, Any]]) -> None:
        m = self.metrics
        for part, check in checks.items():
            m.loop_part_ok.labels(part).set(0 if check["status"] == "degraded" else 1)
        trainer = checks["trainer"]
        for gauge, key in (
            (m.trainer_lag, "lag"),
            (m.trainer_pending, "pending"),
            (m.trainer_heartbeat_age, "heartbeat_age_s"),
            (m.trainer_last_ack_age, "last_ack_age_s"),
        ):
            value = trainer.get(key)
            gauge.set(float("nan") if value is None else value)
        behind = checks["adapters"].get("behind", {})
        for name in self.slots.adapters:
            m.adapter_behind.labels(name).set(1 if name in behind else 0)


def _broken(problem: str) -> dict[str, Any]:
    return {"status": "degraded", "problem": problem}


def _graded(check: dict[str, Any]) -> dict[str, Any]:
    if "problem" in check:
        check["status"] = "degraded"
    return check
