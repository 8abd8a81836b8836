"""A replica that follows another replica's rollback (the pointer moved back) must not keep the
rolled-back version as its baseline: otherwise its own live monitor could judge the older
version worse and move the pointer forward to the loser again. docs/reliability.md."""

from __future__ import annotations

from osd.adapters import open_adapter_store
from osd.buffer.redis_server import LocalRedis
from osd.versions.errors import BASE_VERSION

from .conftest import completion, replica_adapter, running_replica, toy_config, wait_for


def test_a_replica_follows_a_rollback_to_the_base_draft_and_drops_the_loser(
    redis_server: LocalRedis,
) -> None:
    store = open_adapter_store(redis_server.url)
    with running_replica(toy_config(), store=store, rollback_window=32) as replica:
        slots = replica.runtime.slots
        spec, identity = replica_adapter(slots.model)
        loser = store.publish("general", identity, spec=spec, expected_current=None).version
        wait_for(lambda: replica.current() == loser, 10)
        # Another replica's live monitor rolls the version back to the base draft.
        store.rollback("general", BASE_VERSION, expected_current=loser)
        wait_for(lambda: replica.current() == BASE_VERSION, 10)
        previous = slots.previous("general")
        for _ in range(12):  # more than a window of drafted tokens
            assert replica.client.post("/v1/completions", json=completion()).status_code == 200
        replica.watcher.check_rollbacks()
        current_after, pointer_after = replica.current(), store.current("general")
        loaded = sorted(slots.model.peft_config)
    assert previous is None  # the loser is no baseline here
    assert current_after == pointer_after == BASE_VERSION
    assert f"general@{loser}" not in loaded
    store.close()
