"""Redis memory stays bounded (issue 17, "Bounded memory, planned"): the log stream and the
adapter store are driven far past their budgets against a real redis-server with a
``maxmemory`` and the ``noeviction`` policy of docker-compose.yml, and Redis's own
``used_memory`` is watched throughout. Then Redis is made too small: entries are dropped and
counted, the log gives way, a publish fails as "unavailable", and every version a replica serves
or may roll back to still loads."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from osd.adapters import open_adapter_store
from osd.adapters.manifest import AdapterSpec
from osd.buffer.reader import LogReader
from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis, connect
from osd.buffer.writer import LogWriter
from osd.versions.errors import StoreUnavailable
from osd.versions.store_redis import RedisStore

MiB = 2**20
MAXMEMORY = 48 * MiB
LOG_BUDGET = 8 * MiB  # log.max_bytes
KEEP_VERSIONS = 2
RANK, WIDTH = 16, 8192  # one A and one B of fp32: 1 MiB per version
VERSION_BYTES = 2 * RANK * WIDTH * 4
# What is not data, measured at the peaks: Redis's baseline (0.85 MiB), client buffers (a
# 64-record pipeline and a 1 MiB publish in flight: 1.4 MiB), the append-only file's buffer
# (up to 2.5 MiB), and a version being written beside the ones the peak counts. Peaks seen:
# 15.6-20.3 MiB, against 13 MiB of budgets.
SLACK = 10 * MiB
# Versions at once: held, the KEEP_VERSIONS predecessors, current, and one just published.
VERSION_PEAK = (KEEP_VERSIONS + 3) * VERSION_BYTES


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    args = ["--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "noeviction"]
    with LocalRedis(extra_args=args) as server:
        yield server


class MemoryWatch:
    """Polls INFO memory from a thread; `peak` is the largest used_memory seen."""

    def __init__(self, url: str) -> None:
        self.client = connect(url)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, int(self.client.info("memory")["used_memory"]))
            self._stop.wait(0.005)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {
        f"{prefix}.lora_A.weight": torch.randn(RANK, WIDTH, generator=generator),  # (r, in)
        f"{prefix}.lora_B.weight": torch.randn(WIDTH, RANK, generator=generator),  # (out, r)
    }


SPEC = AdapterSpec("synthetic", "0" * 64, RANK, 32.0, ("q_proj",))


def _publish(store: RedisStore, name: str, seed: int) -> int:
    version = store.publish(name, _weights(seed), spec=SPEC, expected_current=store.current(name))
    store.collect_garbage(name, keep_versions=KEEP_VERSIONS, grace_s=0)
    return version.version


def test_log_and_store_past_their_budgets_keep_redis_under_maxmemory(redis_server):
    url, stream, name = redis_server.url, "test:records", "general"
    records = [Record.make_dummy(seed=i, num_generated=48, m=32, prompt_len=32) for i in range(20)]
    store = open_adapter_store(url)
    admin = connect(url)
    writer = LogWriter(url, stream, maxlen=10**6, max_bytes=LOG_BUDGET, batch_size=64)
    try:
        with MemoryWatch(url) as watch:
            for seed in range(3):
                _publish(store, name, seed)
            # A replica keeps v3 as its previous slot (an unproven successor came and went).
            store.report_held("replica-1", {name: [3]}, ttl_s=60)
            for seed in range(3, 40):  # 40 MiB of versions
                _publish(store, name, seed)
                for record in records * 4:  # 3200 records, ~32 MiB
                    writer.log(record)
                assert writer.flush(10)
        metrics = writer.metrics()
        stream_bytes = int(admin.memory_usage(stream, samples=0))
        print(
            f"\npeak used_memory {watch.peak / MiB:.1f} MiB; stream {stream_bytes / MiB:.2f} "
            f"MiB in {admin.xlen(stream)} entries (trim point {metrics.trim_len}); record "
            f"{metrics.mean_record_bytes:.0f} B; versions {store.list_versions(name)}"
        )
        assert metrics.logged == len(records) * 4 * 37 == metrics.written  # nothing dropped
        assert LOG_BUDGET * 0.7 < stream_bytes <= LOG_BUDGET
        assert store.list_versions(name) == [3, 38, 39, 40]  # held, 2 predecessors, current
        assert watch.peak <= LOG_BUDGET + VERSION_PEAK + SLACK < MAXMEMORY

        # Redis too small now (another tenant, a bad budget): the log gives way, nothing else.
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", used - MiB)
        with pytest.raises(StoreUnavailable, match="Redis is full"):
            store.publish(name, _weights(99), spec=SPEC, expected_current=40)
        for record in records * 5:
            writer.log(record)
        assert writer.flush(10)
        after = writer.metrics()
        assert after.dropped_by_reason["redis_error"] > 0  # refused entries are counted
        assert after.written > metrics.written  # and after trimming, written again
        assert after.logged == after.written + after.dropped
        assert int(admin.memory_usage(stream, samples=0)) < stream_bytes
        assert store.current(name) == 40
        for version in (3, 38, 39, 40):  # served, or a rollback target: all still load
            store.load(name, version, expected_base_model_hash=SPEC.base_model_hash)
    finally:
        writer.close()
        store.close()
        admin.close()


def test_the_trainer_reads_and_acks_at_maxmemory_and_a_dead_letter_waits(redis_server):
    url, stream = redis_server.url, "test:full"
    admin = connect(url)
    good = Record.make_dummy(seed=1, request_id="good")
    bad_id = admin.xadd(stream, {"r": b"not a record"}).decode()
    admin.xadd(stream, {"r": good.pack()})
    reader = LogReader(url, stream, consumer="c1")
    try:
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", used - MiB)  # full: writes are refused from now on
        got = reader.read(block_ms=0)  # the bad entry cannot be dead-lettered yet
        assert [r.request_id for _, r in got] == ["good"]
        assert reader.ack([entry_id for entry_id, _ in got]) == 1
        assert reader.metrics().dead_lettered == 0 and reader.metrics().pending == 1
        admin.config_set("maxmemory", MAXMEMORY)
        time.sleep(0.02)
        assert reader.claim_stale(min_idle_ms=10) == []  # now it goes to the dead letters
        assert reader.metrics().dead_lettered == 1
        assert admin.xrange(f"{stream}:dead")[0][1][b"id"].decode() == bad_id
    finally:
        reader.close()
        admin.close()
