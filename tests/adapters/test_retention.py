"""Bounded adapter history on both backends: what `collect_garbage` keeps (current,
predecessors, held, young) and deletes, and loads racing the deletes. Redis tests run against a
real redis-server."""

from __future__ import annotations

import threading
import time

import pytest

from osd.versions.errors import BASE_VERSION, VersionNotFound
from osd.versions.retention import (
    check_replica_id,
    decode_held,
    encode_held,
    make_replica_id,
    unkept_versions,
)


@pytest.mark.parametrize(
    ("versions", "current", "keep", "unkept"),
    [
        ([1, 2, 3, 4, 5, 6, 7], 5, 2, [1, 2, 6, 7]),  # 6, 7: losers above a rollback target
        ([1, 2, 3], 3, 4, []),
        ([3, 1, 2, 2], 3, 1, [1]),
        ([1, 2, 3, 4], None, 2, [1, 2]),  # nothing current: the newest stay
        ([1, 2, 3, 4], BASE_VERSION, 1, [1, 2, 3]),  # rolled back to the base draft
        ([], 4, 3, []),
    ],
)
def test_unkept_versions_are_outside_current_and_its_newest_predecessors(
    versions, current, keep, unkept
):
    assert unkept_versions(versions, current, keep) == unkept


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_keep_versions_below_one_is_refused(keep):
    with pytest.raises(ValueError, match="keep_versions must be an int >= 1"):
        unkept_versions([1, 2], 2, keep)


def test_held_report_round_trips_and_drops_the_base_draft():
    raw = encode_held({"code": [3, 0, 2, 3], "sql": []}, ttl_s=12.5)
    assert decode_held(raw) == (12.5, {"code": [2, 3], "sql": []})
    with pytest.raises(ValueError, match="not a held-versions report"):
        decode_held(b'{"held": {}}')


def test_replica_ids_are_key_safe():
    check_replica_id(make_replica_id())
    for bad in ("", "a:b", "../x", "-x", "x" * 65, 7):
        with pytest.raises(ValueError, match="replica id must be"):
            check_replica_id(bad)


def _publish(store, name, spec, weights, count):
    for _ in range(count):
        store.publish(name, weights, spec=spec, expected_current=store.current(name))
    return store.current(name)


def test_collect_garbage_keeps_current_and_predecessors_and_deletes_the_rest(
    store, adapter_name, spec, code_weights
):
    assert _publish(store, adapter_name, spec, code_weights, 7) == 7
    assert store.collect_garbage(adapter_name, keep_versions=2, grace_s=0) == [1, 2, 3, 4]
    assert store.list_versions(adapter_name) == [5, 6, 7]
    assert store.collect_garbage(adapter_name, keep_versions=2, grace_s=0) == []  # idempotent
    for version in (5, 6, 7):
        store.load(adapter_name, version, expected_base_model_hash=spec.base_model_hash)
    with pytest.raises(VersionNotFound):
        store.load(adapter_name, 1, expected_base_model_hash=spec.base_model_hash)
    # Numbers are never reused, and the store goes on as before.
    assert store.publish(adapter_name, code_weights, spec=spec, expected_current=7).version == 8


def test_young_versions_wait_out_the_grace_period(store, adapter_name, spec, code_weights):
    _publish(store, adapter_name, spec, code_weights, 4)
    assert store.collect_garbage(adapter_name, keep_versions=1, grace_s=60) == []
    assert store.list_versions(adapter_name) == [1, 2, 3, 4]


def test_versions_a_replica_holds_survive_until_its_report_expires(
    store, other_store, adapter_name, spec, code_weights
):
    _publish(store, adapter_name, spec, code_weights, 5)
    other_store.report_held("replica-a", {adapter_name: [1], "other": [2]}, ttl_s=0.5)
    other_store.report_held("replica-b", {adapter_name: [2]}, ttl_s=30)
    assert store.held_versions(adapter_name) == {1, 2}
    assert store.collect_garbage(adapter_name, keep_versions=1, grace_s=0) == [3]
    time.sleep(0.6)
    assert store.held_versions(adapter_name) == {2}
    assert store.collect_garbage(adapter_name, keep_versions=1, grace_s=0) == [1]
    other_store.report_held("replica-b", {adapter_name: []}, ttl_s=30)  # it moved on
    assert store.collect_garbage(adapter_name, keep_versions=1, grace_s=0) == [2]
    assert store.list_versions(adapter_name) == [4, 5]


def test_after_a_rollback_the_loser_goes_and_the_target_stays(
    store, adapter_name, spec, code_weights
):
    _publish(store, adapter_name, spec, code_weights, 3)
    store.rollback(adapter_name, 2, expected_current=3)
    assert store.collect_garbage(adapter_name, keep_versions=1, grace_s=0) == [3]
    assert store.list_versions(adapter_name) == [1, 2]


def test_the_current_version_is_never_deleted(store, adapter_name, spec, code_weights):
    _publish(store, adapter_name, spec, code_weights, 2)
    assert store._delete_version(adapter_name, 2) is False  # the pointer names it
    assert store._delete_version(adapter_name, 9) is False  # no such version
    assert store._delete_version(adapter_name, 1) is True
    assert store.list_versions(adapter_name) == [2]


def test_loads_racing_garbage_collection_get_the_version_or_not_found(
    store, other_store, adapter_name, spec, code_weights
):
    """Replicas load old and new versions while the trainer publishes and collects: each load
    returns checked weights or VersionNotFound (the watcher's refusal), nothing else."""
    _publish(store, adapter_name, spec, code_weights, 2)
    stop = threading.Event()
    outcomes: dict[str, int] = {"loaded": 0, "not_found": 0}
    errors: list[BaseException] = []

    def load_loop(offset: int) -> None:
        while not stop.is_set():
            version = max(1, (other_store.current(adapter_name) or 1) - offset)
            try:
                other_store.load(adapter_name, version, expected_base_model_hash=None)
                outcomes["loaded"] += 1
            except VersionNotFound:
                outcomes["not_found"] += 1
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)
                return

    loaders = [threading.Thread(target=load_loop, args=(offset,)) for offset in (0, 1, 2, 3)]
    for thread in loaders:
        thread.start()
    try:
        for _ in range(40):
            _publish(store, adapter_name, spec, code_weights, 1)
            store.collect_garbage(adapter_name, keep_versions=1, grace_s=0)
    finally:
        stop.set()
        for thread in loaders:
            thread.join(10)
    assert not errors, errors[0]
    assert outcomes["loaded"] > 0
    assert store.list_versions(adapter_name) == [41, 42]
