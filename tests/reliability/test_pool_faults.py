"""A trainer pool's worker through a Redis outage longer than half its lease: it stops training
its adapters (their leases count as lost), keeps their records and unsent acknowledgements, takes
them back when Redis returns, and trains no record twice."""

from __future__ import annotations

import threading
import time
from collections import Counter

from osd.buffer.loop_status import read_pool_status
from osd.buffer.redis_server import LocalRedis, connect
from tests.trainer.conftest import generate_records, headroom_draft, make_config, push
from tests.trainer.test_pool import ADAPTERS, audited, held, relabel, wait_until_accounted
from trainer.examples import adapters_for
from trainer.pool import AUDIT_ENV, PoolWorker, adapter_stream

from .conftest import STREAM, wait_for


def test_a_pool_worker_rides_out_a_redis_restart_and_trains_no_record_twice(
    redis_server: LocalRedis, tmp_path, monkeypatch
):
    url = redis_server.url
    audit = tmp_path / "audit"
    monkeypatch.setenv(AUDIT_ENV, str(audit))
    config = make_config(
        tmp_path, STREAM, "model.adapters=[general,code,sql]", "routing.enabled=false",
        "adapters.store=redis", pool="true", lease_s=1.0, publish_margin=0.0,
    )  # fmt: skip
    worker = PoolWorker(config, url, draft=headroom_draft(), base_model_id="toy")
    logged = relabel(generate_records(48, seed=7, prefix="pool-fault") * 3)
    routed = {(a, r.request_id) for r in logged for a in adapters_for(r, ADAPTERS)}
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(stop)
        except BaseException as exc:  # noqa: BLE001 - asserted on
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        push(url, STREAM, logged[:72])
        wait_for(lambda: sum(len(v) for v in audited(audit).values()) >= 32, 60)
        push(url, STREAM, logged[72:])
        redis_server.kill()
        time.sleep(2.5)  # well past lease_s / 2: every lease counts as lost
        suspended = sorted(worker._suspended)
        alive_while_down = thread.is_alive()
        redis_server.restart()
        client = connect(url)

        def drained() -> bool:
            info = client.xinfo_groups(STREAM)[0]
            if info["pending"] or info["lag"]:
                return False
            groups = [client.xinfo_groups(adapter_stream(STREAM, a)) for a in ADAPTERS]
            if any(g[0]["lag"] for g in groups):
                return False
            statuses = read_pool_status(client, STREAM, config.trainer.group, 10)
            return bool(statuses) and sorted(statuses[0]["adapters"]) == sorted(ADAPTERS)

        wait_for(drained, 90)
        # The last rounds (a fixed 1 s was too short on a loaded 2-core machine).
        wait_until_accounted(audit, url, STREAM, routed)
        client.close()
    finally:
        stop.set()
        thread.join(timeout=60)
        worker.close()
    assert errors == [] and alive_while_down
    assert suspended == sorted(ADAPTERS)  # it stopped using them while Redis was away
    trained = Counter(pair for lines in audited(audit).values() for pair in lines)
    assert max(trained.values()) == 1, [p for p, n in trained.items() if n > 1]
    assert set(trained) | held(url, STREAM) == routed, routed - set(trained) - held(url, STREAM)
