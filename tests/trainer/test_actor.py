"""`TrainerService`, the body of the Ray actor, trains in the background and answers `stats` and
`stop` meanwhile (in-process here; `trainer_actor` only wraps it in `ray.remote`)."""

from __future__ import annotations

import time

from tests.trainer.conftest import headroom_draft, make_config, push
from trainer.actor import TrainerService


def test_service_trains_in_the_background_and_stops_on_request(
    tmp_path, redis_url, stream, records
):
    config = make_config(tmp_path, stream)
    push(redis_url, stream, records[:96])
    service = TrainerService(config, redis_url, draft=headroom_draft(), base_model_id="toy")
    assert service.stats() == {"running": False}

    service.start()
    deadline = time.monotonic() + 60
    while service.stats()["published"] == 0 and time.monotonic() < deadline:
        assert service.running, service.stats()
        time.sleep(0.05)
    final = service.stop(timeout_s=30)

    assert final["published"] >= 1
    assert final["versions"]["general"] >= 1
    assert final["running"] is False and final["error"] is None


def test_a_pool_worker_service_owns_the_adapters_and_trains_them(
    tmp_path, redis_url, stream, records
):
    config = make_config(tmp_path, stream, pool="true", lease_s=1.0)
    push(redis_url, stream, records[:96])
    service = TrainerService(config, redis_url, draft=headroom_draft(), base_model_id="toy")
    service.start()
    deadline = time.monotonic() + 60
    while service.stats().get("published", 0) == 0 and time.monotonic() < deadline:
        assert service.running, service.stats()
        time.sleep(0.05)
    stats = service.stats()
    assert stats["adapters"] == ["general"] and stats["dispatch"]["read"] == 96
    final = service.stop(timeout_s=30)
    assert final["published"] >= 1 and final["versions"]["general"] >= 1
    assert final["running"] is False and final["error"] is None


def test_pool_actors_are_pool_workers(tmp_path, stream):
    import pytest

    from trainer.actor import trainer_pool_actors

    with pytest.raises(ValueError, match="workers"):
        trainer_pool_actors(make_config(tmp_path, stream), "redis://x", workers=0)
