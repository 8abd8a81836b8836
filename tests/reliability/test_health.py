"""/health, /ready and the osd_loop_* gauges tell the truth about the loop around a replica.

Redis is SIGKILLed and restarted, the trainer is stopped and started again, the decode loop is
stopped: each time every view (/health, /ready, /metrics) says what broke, and that it mended.
docs/reliability.md, "Health".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from osd.adapters import open_adapter_store
from serving.health import HealthLimits
from tests.trainer.conftest import headroom_draft, make_config
from trainer.wiring import wire_trainer
from trainer.worker import TrainerWorker

from .conftest import STREAM, metric, running_replica, toy_config, wait_for

LIMITS = HealthLimits(trainer_silent_s=3.0, drop_window_s=1.0)


@contextmanager
def running_trainer(tmp_path: Path, url: str) -> Iterator[TrainerWorker]:
    """A real trainer of the toy draft consuming the replica's stream in a thread."""
    config = make_config(tmp_path, STREAM, "adapters.store=redis", group="trainer")
    worker = wire_trainer(config, url, draft=headroom_draft(), base_model_id="toy")
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(timeout=60)
        worker.close()


def views(replica) -> tuple[dict, dict, str]:
    health = replica.health()
    ready = replica.client.get("/ready")
    assert ready.status_code == 200  # the replica serves whatever the loop does
    return health, ready.json(), replica.metrics()


def part_ok(metrics: str, part: str) -> float:
    return metric(metrics, "osd_loop_part_ok", part=part)


def test_views_follow_redis_and_trainer_down_and_back(redis_server, tmp_path):
    config = toy_config()
    store = open_adapter_store(redis_server.url)
    with running_replica(
        config, redis_url=redis_server.url, store=store, health_limits=LIMITS
    ) as replica:
        # No trainer yet: the loop is degraded, and says why.
        wait_for(lambda: replica.health()["problems"], 10)
        health, ready, metrics = views(replica)
        assert health["status"] == "degraded" and ready["ready"] is True
        assert health["problems"] == ["trainer: no trainer has reported on this stream"]
        assert part_ok(metrics, "trainer") == 0 and part_ok(metrics, "log_buffer") == 1

        with running_trainer(tmp_path, redis_server.url):
            wait_for(lambda: replica.health()["status"] == "ok", 20)
            assert replica.complete().status_code == 200
            wait_for(lambda: replica.client.get("/ready").json()["checks"]["trainer"]["pid"], 10)
            health, ready, metrics = views(replica)
            trainer = ready["checks"]["trainer"]
            assert trainer["status"] == "ok" and trainer["heartbeat_age_s"] < 10
            assert ready["checks"]["adapter_store"]["status"] == "ok"
            assert all(part_ok(metrics, part) == 1 for part in ready["checks"])

            # Redis dies: requests are still served; every part that needs it says so.
            redis_server.kill()
            assert replica.complete().status_code == 200
            wait_for(lambda: len(replica.health()["problems"]) >= 3, 15)
            health, ready, metrics = views(replica)
            parts = {p.split(":")[0] for p in health["problems"]}
            assert {"log_buffer", "adapter_store", "trainer"} <= parts, health
            assert ready["checks"]["log_buffer"]["reachable"] is False
            assert part_ok(metrics, "log_buffer") == 0
            assert part_ok(metrics, "adapter_store") == 0

            # Back: the same views say ok again, once a record got through.
            redis_server.restart()
            wait_for(lambda: replica.complete().status_code == 200, 10)
            wait_for(lambda: replica.health()["status"] == "ok", 30)
            metrics = replica.metrics()
            assert all(part_ok(metrics, p) == 1 for p in ("log_buffer", "adapter_store"))

        # The trainer stops: its heartbeat goes quiet and the views say so.
        wait_for(lambda: replica.health()["problems"], LIMITS.trainer_silent_s + 10)
        health, ready, metrics = views(replica)
        assert [p.split(":")[0] for p in health["problems"]] == ["trainer"]
        assert "no heartbeat" in health["problems"][0]
        # The age is reported to a tenth of a second: 3.04 s silent (flagged) reads 3.0.
        assert metric(metrics, "osd_trainer_heartbeat_age_seconds") >= LIMITS.trainer_silent_s

        with running_trainer(tmp_path, redis_server.url):
            wait_for(lambda: replica.health()["status"] == "ok", 20)


def test_records_the_trainer_holds_to_judge_on_are_not_a_stale_backlog(redis_server, tmp_path):
    """Fewer records than a judge window keeps: all stay pending (not trained, so not
    acknowledged) for as long as no newer ones come; the trainer reports them in its beat, and
    the replica does not count them as records waiting for it."""
    limits = HealthLimits(drop_window_s=1.0, ack_stale_s=1.0)
    store = open_adapter_store(redis_server.url)
    with (
        running_replica(
            toy_config(), redis_url=redis_server.url, store=store, health_limits=limits
        ) as replica,
        running_trainer(tmp_path, redis_server.url),
    ):
        for _ in range(3):
            assert replica.complete().status_code == 200

        def trainer_check() -> dict:
            return replica.client.get("/ready").json()["checks"]["trainer"]

        wait_for(lambda: trainer_check().get("judging") == 3, 20)
        time.sleep(limits.ack_stale_s + 0.5)  # nothing acknowledged for longer than allowed
        check = trainer_check()
        assert (check["pending"], check["judging"], check["status"]) == (3, 3, "ok"), check
        assert replica.health()["status"] == "ok"


def test_ready_is_503_when_the_decode_loop_stopped():
    with running_replica(toy_config()) as replica:
        ready = replica.client.get("/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ok"  # nothing to check
        assert ready.json()["checks"]["log_buffer"]["status"] == "off"
        replica.runtime.batch.close()
        assert replica.client.get("/ready").status_code == 503
        assert replica.client.get("/health").status_code == 200  # alive, though not serving


def test_a_trainer_pool_shows_each_worker_its_adapters_and_their_lag(redis_server, tmp_path):
    """With a pool (`trainer.pool`), /ready's trainer check lists every worker: its adapters,
    whether it dispatches the log, and how far its adapters' streams are behind."""
    from trainer.pool import PoolWorker

    config = make_config(
        tmp_path, STREAM, "adapters.store=redis", group="trainer", pool="true", lease_s=1.0
    )
    worker = PoolWorker(config, redis_server.url, draft=headroom_draft(), base_model_id="toy")
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    with running_replica(toy_config(), redis_url=redis_server.url, health_limits=LIMITS) as replica:
        thread.start()
        try:
            for _ in range(3):
                assert replica.complete().status_code == 200

            def workers() -> list:
                return replica.client.get("/ready").json()["checks"]["trainer"].get("workers", [])

            wait_for(lambda: len(workers()) == 1 and workers()[0]["adapters"] == ["general"], 30)
            (shown,) = workers()
            assert shown["worker"] == worker.worker_id and shown["dispatching"] is True
            assert shown["lag"] == 0 and shown["report_age_s"] < 10
            wait_for(lambda: replica.health().get("trainer_workers") == workers(), 10)
        finally:
            stop.set()
            thread.join(timeout=60)
            worker.close()
    with running_replica(toy_config(), redis_url=redis_server.url, health_limits=LIMITS) as replica:
        # A worker that left the pool is no longer shown.
        assert "workers" not in replica.client.get("/ready").json()["checks"]["trainer"]
