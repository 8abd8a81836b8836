"""Benchmark of the log buffer: record size, write and read rates, and what `log()` costs a replica.

Run from the repository root::

    python -m bench.bench_log_buffer [--records 2000] [--decode-step-ms 25] [--redis-url URL]

It starts its own redis-server (LocalRedis) unless given a URL, and prints small tables; there is
no pass or fail. The peer for `log()` is a synchronous XADD on the caller thread, which is what
logging would cost without the queue and background thread.
"""

from __future__ import annotations

import argparse
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from bench.tables import print_table
from osd.buffer.reader import LogReader
from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis, connect
from osd.buffer.writer import LogWriter, WriterMetrics

NUM_GENERATED, TOP_M, PROMPT_LEN, VOCAB_SIZE = 256, 32, 128, 32_000


def _time_us(fn: Callable[[], object], repeats: int = 200) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e6


def _percentiles_ms(durations_ns: Sequence[int]) -> tuple[float, float, float]:
    ms = np.asarray(durations_ns, dtype=np.float64) / 1e6
    p50, p99 = np.percentile(ms, [50, 99])
    return float(p50), float(p99), float(ms.max())


def bench_sizes() -> None:
    """Bytes per packed record, with and without the prompt, and what zlib would change."""
    rows = []
    for prompt_len in (0, PROMPT_LEN):
        record = Record.make_dummy(
            num_generated=NUM_GENERATED, m=TOP_M, prompt_len=prompt_len, vocab_size=VOCAB_SIZE
        )
        data = record.pack()
        compressed = zlib.compress(data, 1)
        rows.append(
            [
                f"{NUM_GENERATED} generated, prompt {prompt_len}, m {TOP_M}",
                len(data),
                f"{len(compressed)} ({len(compressed) / len(data):.0%})",
                f"{_time_us(partial(zlib.compress, data, 1), 50):.0f}",
                f"{_time_us(record.pack):.0f}",
                f"{_time_us(partial(Record.unpack, data)):.0f}",
            ]
        )
    header = ["record", "bytes", "zlib-1 bytes", "zlib-1 us", "pack us", "unpack us"]
    print_table("Packed record size (dummy data, vocab 32000)", header, rows)


def _log_all(writer: LogWriter, records: Sequence[Record], num: int, pace_s: float) -> list[int]:
    durations_ns = []
    for i in range(num):
        started = time.perf_counter_ns()
        writer.log(records[i % len(records)])
        durations_ns.append(time.perf_counter_ns() - started)
        if pace_s:
            time.sleep(pace_s)
    return durations_ns


def _dummy_records(count: int) -> list[Record]:
    return [
        Record.make_dummy(
            num_generated=NUM_GENERATED,
            m=TOP_M,
            prompt_len=PROMPT_LEN,
            seed=s,
            vocab_size=VOCAB_SIZE,
        )
        for s in range(count)
    ]


def bench_write(
    url: str, stream: str, records: Sequence[Record], num: int
) -> tuple[float, list[int], list[int], WriterMetrics]:
    """Records/s from the first log() of a burst to the last XADD; log() times, burst and paced."""
    with LogWriter(url, stream, maxlen=10 * num, queue_size=num) as writer:
        started = time.perf_counter()
        burst = _log_all(writer, records, num, pace_s=0.0)
        writer.flush(120)
        rate = writer.metrics().written / (time.perf_counter() - started)
        paced = _log_all(writer, records, min(num, 1000), pace_s=0.001)
        return rate, burst, paced, writer.close(60)


def bench_sync_xadd(url: str, stream: str, records: Sequence[Record], num: int) -> list[int]:
    """The peer: one XADD per record on the caller thread (records packed beforehand)."""
    client = connect(url)
    packed = [r.pack() for r in records]
    durations_ns = []
    for i in range(num):
        started = time.perf_counter_ns()
        client.xadd(stream, {"r": packed[i % len(packed)]}, maxlen=1000, approximate=True)
        durations_ns.append(time.perf_counter_ns() - started)
    client.delete(stream)
    return durations_ns


def bench_read(url: str, stream: str) -> tuple[int, float]:
    """Records/s of the trainer's loop: XREADGROUP, unpack, XACK, until the stream is drained."""
    reader = LogReader(url, stream, group="bench", consumer="bench")
    started, num_read = time.perf_counter(), 0
    while batch := reader.read(count=256, block_ms=0):
        reader.ack(entry_id for entry_id, _ in batch)
        num_read += len(batch)
    elapsed = time.perf_counter() - started
    reader.close()
    return num_read, num_read / elapsed


def bench_log_buffer(url: str, num: int, decode_step_ms: float | None) -> None:
    """Runs the write, peer and read benchmarks against `url` and prints their tables."""
    records = _dummy_records(16)
    stream = f"bench:{uuid.uuid4().hex[:8]}"
    write_rate, burst, paced, m = bench_write(url, stream, records, num)
    sync = bench_sync_xadd(url, f"{stream}:sync", records, min(num, 500))
    num_read, read_rate = bench_read(url, stream)
    connect(url).delete(stream)
    rates = [
        ["write (log -> XADD pipeline)", num, f"{write_rate:,.0f}"],
        ["read (XREADGROUP + unpack + XACK)", num_read, f"{read_rate:,.0f}"],
    ]
    print_table("Throughput through local redis", ["path", "records", "records/s"], rates)
    calls = [
        ("log(), burst", burst),
        ("log(), paced 1 ms", paced),
        ("peer: sync XADD, prepacked", sync),
    ]
    header = ["call", "p50 ms", "p99 ms", "max ms"]
    if decode_step_ms:
        header += [f"p50 / {decode_step_ms} ms step", "p99 / step"]
    rows = []
    for name, durations in calls:
        p50, p99, worst = _percentiles_ms(durations)
        row = [name, f"{p50:.4f}", f"{p99:.4f}", f"{worst:.3f}"]
        if decode_step_ms:
            row += [f"{p50 / decode_step_ms:.3%}", f"{p99 / decode_step_ms:.3%}"]
        rows.append(row)
    print_table("Time on the caller thread", header, rows)
    print(f"\n  writer: written {m.written}, dropped {m.dropped} {dict(m.dropped_by_reason)}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000, help="records to write and read")
    parser.add_argument("--decode-step-ms", type=float, default=None, help="a decode step, in ms")
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    args = parser.parse_args(argv)
    if args.records < 1:
        parser.error(f"--records must be >= 1, got {args.records}")
    bench_sizes()
    if args.redis_url:
        bench_log_buffer(args.redis_url, args.records, args.decode_step_ms)
    else:
        with LocalRedis() as server:
            bench_log_buffer(server.url, args.records, args.decode_step_ms)


if __name__ == "__main__":
    main()
