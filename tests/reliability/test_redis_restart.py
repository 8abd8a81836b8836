"""Redis SIGKILLed and restarted under traffic: serving goes on, records are dropped and counted,
logging resumes, a published adapter version survives (AOF) and the watcher reconnects.

docs/design.md, "Never block serving"; docs/reliability.md, rows "Redis SIGKILL".
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

from osd.adapters import open_adapter_store
from osd.buffer.record import Record
from osd.buffer.redis_server import connect
from osd.buffer.writer import LogWriter
from osd.versions.errors import PointerEvent

from .conftest import STREAM, metric, replica_adapter, running_replica, toy_config, wait_for


def records_by_domain(url: str) -> Counter[str]:
    client = connect(url)
    try:
        return Counter(Record.unpack(f[b"r"]).domain for _, f in client.xrange(STREAM))
    finally:
        client.close()


class Traffic:
    """A client thread sending requests back to back, each labelled (as its `domain`, which its
    record carries) with the phase of the test it was sent in."""

    def __init__(self, replica) -> None:
        self.replica, self.phase = replica, "before"
        self.outcomes: list[tuple[str, int, float]] = []  # (phase, status, seconds)
        self._stop, self._paused = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            phase, start = self.phase, time.perf_counter()
            if phase == "paused":
                self._paused.set()
                time.sleep(0.01)
                continue
            self._paused.clear()
            status = self.replica.complete(domain=phase).status_code
            self.outcomes.append((phase, status, time.perf_counter() - start))

    def pause(self) -> None:
        """Stops sending once the request in flight has finished (and queued its record)."""
        self.phase = "paused"
        assert self._paused.wait(30)

    def count(self, phase: str) -> int:
        return sum(1 for p, _, _ in self.outcomes if p == phase)

    def enter(self, phase: str, min_requests: int, timeout_s: float = 30.0) -> None:
        """Switches phase and waits until `min_requests` of it have finished."""
        self.phase = phase
        wait_for(lambda: self.count(phase) >= min_requests, timeout_s)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_redis_sigkill_and_restart_under_traffic_loses_only_counted_records(redis_server):
    config = toy_config()
    store = open_adapter_store(redis_server.url)
    with running_replica(config, redis_url=redis_server.url, store=store) as replica:
        writer: LogWriter = replica.writer
        spec, identity = replica_adapter(replica.runtime.slots.model)
        v1 = store.publish("general", identity, spec=spec, expected_current=None).version
        wait_for(lambda: replica.current() == v1, 10)

        with Traffic(replica) as traffic:
            traffic.enter("before", 10)
            traffic.pause()
            assert writer.flush(5)

            redis_server.kill()
            killed_at = time.perf_counter()
            traffic.enter("down", 20)
            wait_for(lambda: writer.metrics().dropped > 0, 15)  # batches ran out of attempts
            time.sleep(max(0.0, 2.0 - (time.perf_counter() - killed_at)))  # down >= 2 s
            down_health = replica.health()
            down_metrics = replica.metrics()

            redis_server.restart()
            down_s = time.perf_counter() - killed_at
            written_while_down = writer.metrics().written
            traffic.phase = "after"
            resumed_s = wait_for(lambda: writer.metrics().written > written_while_down, 15)
            traffic.enter("after", 10)
            # A fresh client: the test's own pooled connection died with the old server.
            store = open_adapter_store(redis_server.url)
            pointer_after_restart = store.current("general")
            v2 = store.publish("general", identity, spec=spec, expected_current=v1).version
            swap_s = wait_for(lambda: replica.current() == v2, 15)
            traffic.phase = "end"
        sent_after = traffic.count("after")
        final = writer.close()
        assert replica.watcher.alive

    statuses = Counter((phase, status) for phase, status, _ in traffic.outcomes)
    down_latencies = sorted(s for phase, _, s in traffic.outcomes if phase == "down")
    stored = records_by_domain(redis_server.url)
    print(
        f"\n[redis-kill] requests {dict(statuses)}; down {down_s:.2f} s; latency while down "
        f"p50 {down_latencies[len(down_latencies) // 2] * 1e3:.0f} ms max "
        f"{down_latencies[-1] * 1e3:.0f} ms; writer {final}; stored by phase {dict(stored)}; "
        f"writing resumed {resumed_s:.2f} s after the restart; v{v2} published after it swapped "
        f"in after {swap_s:.2f} s"
    )
    # Every request succeeded, Redis or not.
    assert {status for (_, status) in statuses} == {200}
    assert down_latencies[-1] < 2.0  # nothing waited on Redis
    assert down_health["adapters"]["general"] == v1
    # Drops are counted, shown at /metrics, and the books balance.
    assert metric(down_metrics, "osd_log_records_dropped") > 0
    assert final.dropped > 0 and final.dropped_by_reason["redis_error"] > 0
    assert final.written + final.dropped == final.logged == len(traffic.outcomes)
    # Nothing written before the kill was lost (AOF), nothing sent after the restart was dropped
    # (>=: delivery is at least once, a batch cut off mid-flight may be stored twice).
    assert stored["before"] >= traffic.count("before")
    assert stored["after"] >= sent_after
    assert sum(stored.values()) >= final.written
    # The published version survived the restart; the watcher reconnected and followed.
    assert pointer_after_restart == v1


def test_frozen_redis_delays_no_request_and_its_records_are_written_or_counted(redis_server):
    """SIGSTOP: Redis accepts connections but answers nothing, the slow failure mode (a round
    trip ends by the writer's socket timeout, not by a refused connection)."""
    with running_replica(toy_config(), redis_url=redis_server.url) as replica:
        writer: LogWriter = replica.writer
        with Traffic(replica) as traffic:
            traffic.enter("before", 5)
            os.kill(redis_server.pid, signal.SIGSTOP)
            frozen_at = time.perf_counter()
            try:
                traffic.enter("frozen", 20)
                wait_for(lambda: writer.metrics().failed_round_trips > 0, 15)
                time.sleep(max(0.0, 3.0 - (time.perf_counter() - frozen_at)))  # frozen >= 3 s
                # The probe's PING waits out its 2 s timeout before it can say so.
                wait_for(
                    lambda: any(p.startswith("log_buffer: ") for p in replica.health()["problems"]),
                    15,
                )
                frozen_health = replica.health()
            finally:
                os.kill(redis_server.pid, signal.SIGCONT)
            frozen_s = time.perf_counter() - frozen_at
            traffic.enter("after", 10)
            traffic.phase = "end"
        final = writer.close()

    statuses = Counter((phase, status) for phase, status, _ in traffic.outcomes)
    frozen_latencies = sorted(s for phase, _, s in traffic.outcomes if phase == "frozen")
    stored = records_by_domain(redis_server.url)
    print(
        f"\n[redis-freeze] requests {dict(statuses)}; frozen {frozen_s:.2f} s; latency while "
        f"frozen p50 {frozen_latencies[len(frozen_latencies) // 2] * 1e3:.0f} ms max "
        f"{frozen_latencies[-1] * 1e3:.0f} ms; writer {final}; stored by phase {dict(stored)}"
    )
    assert {status for (_, status) in statuses} == {200}
    # Alive and serving, and honest about the loop: records are not getting through.
    assert frozen_health["status"] == "degraded"
    assert any(p.startswith("log_buffer: ") for p in frozen_health["problems"])
    assert frozen_latencies[-1] < 2.0
    assert final.written + final.dropped == final.logged == len(traffic.outcomes)
    assert stored["after"] >= traffic.count("after")
    assert sum(stored.values()) >= final.written  # timed-out batches may still have landed


def test_a_version_fetched_while_redis_is_down_is_not_refused_and_swaps_in_once_it_is_back(
    redis_server,
):
    """A fetch that fails because Redis is away says nothing about the version: the watcher
    must try it again, not refuse it for good as it refuses a tampered one."""
    store = open_adapter_store(redis_server.url)
    with running_replica(toy_config(), store=store) as replica:
        replica.watcher.stop()  # the test drives the watcher's steps itself
        wait_for(lambda: not replica.watcher.alive, 10)
        spec, identity = replica_adapter(replica.runtime.slots.model)
        version = store.publish("general", identity, spec=spec, expected_current=None).version
        redis_server.kill()
        replica.watcher.handle(PointerEvent("general", version))  # the fetch fails
        failed_metrics = replica.metrics()
        redis_server.restart()
        replica.watcher.reconcile()
        current = replica.current()
    print(f"\n[fetch while down] after the restart the replica runs v{current}")
    assert metric(failed_metrics, "osd_adapter_refusals_total") == 0
    assert current == version
