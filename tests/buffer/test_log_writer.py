"""LogWriter: records reach the stream, and serving never waits or fails when Redis does."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np
import pytest

from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis, connect
from osd.buffer.writer import DROP_REASONS, LogWriter, WriterMetrics

pytestmark = pytest.mark.timeout(60)

# MAXLEN ~ trims whole radix-tree nodes; a node holds up to stream-node-max-entries (100 by
# default) entries, so an approximately trimmed stream may exceed maxlen by up to that many.
APPROX_TRIM_SLACK = 100


def stream_records(url: str, stream: str) -> list[Record]:
    return [Record.unpack(fields[b"r"]) for _, fields in connect(url).xrange(stream)]


def assert_balanced(m: WriterMetrics) -> None:
    assert m.written + m.dropped == m.logged, m
    assert m.dropped == sum(m.dropped_by_reason.values())
    assert set(m.dropped_by_reason) == set(DROP_REASONS)


def test_logged_records_arrive_in_order_and_round_trip(redis_url: str, stream: str) -> None:
    records = [Record.make_dummy(seed=i, num_generated=32, m=8) for i in range(300)]
    with LogWriter(redis_url, stream, batch_size=16) as writer:
        assert all(writer.log(r) for r in records)
        assert writer.flush(10)
        m = writer.metrics()
    assert (m.logged, m.written, m.dropped, m.queue_depth) == (300, 300, 0, 0)
    assert m.connected and m.last_write_ms > 0 and m.max_write_ms >= m.ewma_write_ms > 0
    assert stream_records(redis_url, stream) == records


def test_opted_out_records_are_counted_but_never_written(redis_url: str, stream: str) -> None:
    with LogWriter(redis_url, stream) as writer:
        for i in range(10):
            queued = writer.log(Record.make_dummy(seed=i), opt_out=i % 2 == 1)
            assert queued == (i % 2 == 0)
        m = writer.close()
    assert (m.logged, m.written, m.opted_out) == (5, 5, 5)
    written_ids = {r.request_id for r in stream_records(redis_url, stream)}
    assert written_ids == {f"req-{i}" for i in range(0, 10, 2)}


def test_unpackable_record_is_dropped_as_encode_error(redis_url: str, stream: str) -> None:
    with LogWriter(redis_url, stream) as writer:
        writer.log(object())  # type: ignore[arg-type]
        writer.log(Record.make_dummy())
        m = writer.close()
    assert m.dropped_by_reason["encode_error"] == 1 and m.written == 1
    assert_balanced(m)


def test_full_queue_drops_without_blocking_while_redis_is_unreachable(
    unreachable_url: str, stream: str
) -> None:
    writer = LogWriter(
        unreachable_url, stream, queue_size=10, backoff_initial_s=0.05, backoff_max_s=0.05
    )
    record = Record.make_dummy()
    started = time.perf_counter()
    results = [writer.log(record) for _ in range(1000)]
    elapsed_s = time.perf_counter() - started
    m = writer.close(timeout_s=0.2)
    assert elapsed_s < 0.5
    assert results.count(True) <= 20  # the queue, plus what the thread took out of it
    assert m.dropped_by_reason["queue_full"] >= 980
    assert m.written == 0 and not m.connected and m.failed_round_trips >= 1
    assert_balanced(m)


def test_log_after_close_is_dropped_as_closed(redis_url: str, stream: str) -> None:
    writer = LogWriter(redis_url, stream)
    writer.close()
    assert writer.log(Record.make_dummy()) is False
    m = writer.close()
    assert m.dropped_by_reason["closed"] == 1
    assert_balanced(m)


def test_writer_keeps_serving_through_redis_kill_and_resumes(
    private_redis: LocalRedis, stream: str
) -> None:
    writer = LogWriter(
        private_redis.url,
        stream,
        queue_size=200,
        batch_size=32,
        socket_timeout_s=0.5,
        backoff_initial_s=0.01,
        backoff_max_s=0.1,
    )
    records = [Record.make_dummy(seed=i, num_generated=64, m=16) for i in range(20)]
    durations_ns: list[int] = []
    restarted = threading.Event()

    def log_timed(record: Record) -> None:
        started = time.perf_counter_ns()
        writer.log(record)
        durations_ns.append(time.perf_counter_ns() - started)

    def kill_then_restart() -> None:
        time.sleep(0.1)
        private_redis.kill()
        time.sleep(0.4)
        private_redis.restart()
        restarted.set()

    chaos = threading.Thread(target=kill_then_restart)
    chaos.start()
    i = 0
    while not restarted.is_set():
        log_timed(records[i % len(records)])
        i += 1
        if i % 20 == 0:
            time.sleep(0.001)  # a replica finishes requests at a rate, not in one burst
    chaos.join()
    assert writer.flush(10)
    after = [dataclasses.replace(r, request_id=f"after-{j}") for j, r in enumerate(records * 5)]
    for record in after:
        log_timed(record)
    assert writer.flush(10)
    m = writer.close(timeout_s=5)

    ms = np.array(durations_ns) / 1e6
    p50, p99 = np.percentile(ms, [50, 99])
    print(
        f"\nlog() over {len(ms)} calls: p50 {p50:.4f} ms, p99 {p99:.4f} ms, max {ms.max():.3f} ms"
    )
    print(m)
    assert ms.max() < 20.0
    assert m.failed_round_trips >= 1 and m.dropped > 0  # the kill was felt and absorbed
    assert_balanced(m)
    arrived = {r.request_id for r in stream_records(private_redis.url, stream)}
    assert {r.request_id for r in after} <= arrived


def test_stream_length_stays_within_maxlen_plus_trim_slack(redis_url: str, stream: str) -> None:
    maxlen = 1000
    record = Record.make_dummy(num_generated=1, m=1, prompt_len=1)
    with LogWriter(redis_url, stream, maxlen=maxlen, batch_size=256, queue_size=20_000) as writer:
        for _ in range(10 * maxlen):
            writer.log(record)
        m = writer.close(timeout_s=20)
    assert m.written == 10 * maxlen
    length = connect(redis_url).xlen(stream)
    assert maxlen <= length <= maxlen + APPROX_TRIM_SLACK


def test_password_url_works_and_a_wrong_one_fails_at_construction(stream: str) -> None:
    with LocalRedis(password="pw-123") as server:
        with LogWriter(server.url, stream) as writer:
            writer.log(Record.make_dummy())
            assert writer.flush(5)
        assert connect(server.url).xlen(stream) == 1
        no_password = f"redis://127.0.0.1:{server.port}/0"
        wrong_password = f"redis://:nope@127.0.0.1:{server.port}/0"
        for url in (no_password, wrong_password):
            with pytest.raises(ValueError, match=r"127\.0\.0\.1.*rejected the credentials"):
                LogWriter(url, stream)
        with pytest.raises(ValueError) as info:
            LogWriter(wrong_password, stream)
        assert "nope" not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"maxlen": 0}, "maxlen must be >= 1, got 0"),
        ({"queue_size": -1}, "queue_size must be >= 1"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"socket_timeout_s": 0}, "socket_timeout_s must be positive"),
        ({"backoff_max_s": -1.0}, "backoff_max_s must be positive"),
        ({"stream": ""}, "stream must not be empty"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LogWriter("redis://127.0.0.1:1/0", **kwargs)
