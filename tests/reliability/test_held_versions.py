"""A replica tells the adapter store which versions it holds (current and previous slot), and
the trainer's garbage collection deletes old versions but never those (docs/capacity.md)."""

from __future__ import annotations

from osd.adapters import open_adapter_store
from osd.buffer.redis_server import LocalRedis

from .conftest import replica_adapter, running_replica, toy_config, wait_for


def test_versions_a_replica_holds_survive_garbage_collection(redis_server: LocalRedis) -> None:
    store = open_adapter_store(redis_server.url)
    with running_replica(toy_config(), store=store) as replica:
        assert replica.watcher is not None
        spec, identity = replica_adapter(replica.runtime.slots.model)
        for expected in (None, 1, 2):
            store.publish("general", identity, spec=spec, expected_current=expected)
        wait_for(lambda: replica.runtime.slots.current("general") == 3, 10)
        wait_for(lambda: store.held_versions("general") == {2, 3}, 5)
        replica.watcher.stop()  # it stays at v3 (v2 as previous) while the trainer goes on
        wait_for(lambda: not replica.watcher.alive, 5)
        for expected in (3, 4, 5):
            store.publish("general", identity, spec=spec, expected_current=expected)
        deleted = store.collect_garbage("general", keep_versions=1, grace_s=0)
    assert deleted == [1, 4]  # v5 is the predecessor kept; v2 and v3 are held
    assert store.list_versions("general") == [2, 3, 5, 6]
    store.close()
