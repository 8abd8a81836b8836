"""The adapter store on both backends: round trips, immutability, compare-and-set, crashes,
refusals on load, rollback and notifications. Redis tests run against a real redis-server."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import threading
import time

import pytest
import torch

from osd.adapters import open_adapter_store
from osd.adapters.lora import lora_shapes
from osd.versions.errors import (
    BASE_VERSION,
    PointerEvent,
    PublishConflict,
    StoreError,
    StoreUnavailable,
    VersionIntegrityError,
    VersionNotFound,
    VersionTooLarge,
)
from osd.versions.store_dir import DirectoryStore
from osd.versions.store_redis import RedisStore

from .conftest import make_store, tiny_base


def _assert_same_weights(actual, expected):
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=0)


def test_publish_then_load_round_trips_weights_and_manifest(
    store, adapter_name, spec, code_weights
):
    manifest = store.publish(
        adapter_name, code_weights, spec=spec, expected_current=None, acceptance_estimate=0.62
    )
    assert (manifest.version, manifest.parent_version, manifest.rank) == (1, None, 4)
    assert manifest.target_modules == ("q_proj", "v_proj")
    assert store.current(adapter_name) == 1
    assert store.list_versions(adapter_name) == [1]
    assert adapter_name in store.names()

    loaded, weights = store.load(adapter_name, 1, expected_base_model_hash=spec.base_model_hash)
    assert loaded == manifest
    assert loaded.acceptance_estimate == 0.62
    _assert_same_weights(weights, code_weights)


def test_versions_increase_and_record_their_parent(store, adapter_name, spec, code_weights):
    first = store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    second = store.publish(adapter_name, code_weights, spec=spec, expected_current=first.version)
    assert (first.version, second.version, second.parent_version) == (1, 2, 1)
    assert store.current(adapter_name) == 2


def test_published_versions_are_immutable(store, adapter_name, spec, code_weights, sql_weights):
    first = store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    store.publish(adapter_name, sql_weights, spec=spec, expected_current=1)
    manifest, weights = store.load(adapter_name, 1, expected_base_model_hash=spec.base_model_hash)
    assert manifest == first
    _assert_same_weights(weights, code_weights)
    with pytest.raises(Exception, match="exists already|could not store"):
        store._write_version(first, b"other bytes")  # the store itself cannot rewrite it
    _assert_same_weights(
        store.load(adapter_name, 1, expected_base_model_hash=None)[1], code_weights
    )


def test_directory_versions_are_read_only_files(tmp_path, adapter_name, spec, code_weights):
    store = open_adapter_store(tmp_path)
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    version_dir = tmp_path / adapter_name / "v1"
    assert sorted(p.name for p in version_dir.iterdir()) == ["adapter.safetensors", "manifest.json"]
    assert all(p.stat().st_mode & 0o222 == 0 for p in version_dir.iterdir())


@pytest.mark.parametrize(
    ("code", "raised"),
    [(errno.ENOSPC, StoreUnavailable), (errno.EACCES, StoreError)],
)
def test_directory_write_errors_leave_the_pointer_and_say_whether_to_retry(
    tmp_path, monkeypatch, adapter_name, spec, code_weights, sql_weights, code, raised
):
    """A full disk passes (the trainer publishes later, as after a Redis outage); a permission
    error is a deployment to fix. Either way nothing half-written is left or pointed to."""
    import osd.versions.store_dir as store_dir

    store = open_adapter_store(tmp_path)
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    write = store_dir._write_durably

    def failing_write(path, data, mode=0o644):
        if path.name == "adapter.safetensors":
            raise OSError(code, os.strerror(code), str(path))
        write(path, data, mode)

    monkeypatch.setattr(store_dir, "_write_durably", failing_write)
    with pytest.raises(raised) as caught:
        store.publish(adapter_name, sql_weights, spec=spec, expected_current=1)
    assert isinstance(caught.value, StoreUnavailable) == (code == errno.ENOSPC)
    assert store.current(adapter_name) == 1 and store.list_versions(adapter_name) == [1]
    assert not list((tmp_path / adapter_name).glob(".tmp-*"))
    monkeypatch.setattr(store_dir, "_write_durably", write)
    assert store.publish(adapter_name, sql_weights, spec=spec, expected_current=1).version == 3


def test_directory_publish_removes_what_killed_publishes_left_behind(
    tmp_path, adapter_name, spec, code_weights
):
    store = open_adapter_store(tmp_path)
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    directory = tmp_path / adapter_name
    old_dir, old_file = directory / ".tmp-v7-dead", directory / ".CURRENT.tmp-dead"
    new_dir = directory / ".tmp-v8-in-progress"  # another publisher's, still being written
    for path in (old_dir, new_dir):
        path.mkdir()
        (path / "adapter.safetensors").write_bytes(b"partial")
    old_file.write_bytes(b"7\n")
    two_hours_ago = time.time() - 7200
    for path in (old_dir, old_file):
        os.utime(path, (two_hours_ago, two_hours_ago))
    store.publish(adapter_name, code_weights, spec=spec, expected_current=1)
    assert not old_dir.exists() and not old_file.exists()
    assert new_dir.is_dir()
    assert store.list_versions(adapter_name) == [1, 2]


def test_stale_publisher_gets_conflict_and_pointer_keeps_a_valid_version(
    store, other_store, adapter_name, spec, code_weights, sql_weights
):
    # Both trainers start from "no version yet"; the first one to publish wins.
    winner = store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    with pytest.raises(PublishConflict, match="names version 1, not the expected None") as info:
        other_store.publish(adapter_name, sql_weights, spec=spec, expected_current=None)
    assert (info.value.actual, info.value.new) == (1, 2)
    assert store.current(adapter_name) == winner.version == 1
    _, weights = store.load(adapter_name, 1, expected_base_model_hash=spec.base_model_hash)
    _assert_same_weights(weights, code_weights)
    # The loser's version is stored, complete and immutable, but not current.
    assert store.list_versions(adapter_name) == [1, 2]


def test_concurrent_publishers_exactly_one_wins(
    backend, tmp_path, request, adapter_name, spec, code_weights
):
    stores = [make_store(backend, tmp_path, request) for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    outcomes: list[str] = []

    def publish(store):
        barrier.wait()
        try:
            store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
            outcomes.append("won")
        except PublishConflict:
            outcomes.append("conflict")

    threads = [threading.Thread(target=publish, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes) == ["conflict"] * 3 + ["won"]
    assert stores[0].list_versions(adapter_name) == [1, 2, 3, 4]
    current = stores[0].current(adapter_name)
    assert current in (1, 2, 3, 4)
    stores[0].load(adapter_name, current, expected_base_model_hash=spec.base_model_hash)


def test_half_written_version_is_never_visible(store, raw, adapter_name, spec, code_weights):
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    crashed = raw.crash_after_weights(adapter_name, b"partial weights")
    assert crashed == 2
    assert store.current(adapter_name) == 1
    assert store.list_versions(adapter_name) == [1]
    with pytest.raises(VersionNotFound):
        store.load(adapter_name, crashed, expected_base_model_hash=None)
    with pytest.raises(VersionNotFound):
        store.rollback(adapter_name, crashed, expected_current=1)
    # The store carries on: the next publish skips the crashed number.
    assert store.publish(adapter_name, code_weights, spec=spec, expected_current=1).version == 3


def _tampered(payload: bytes) -> bytes:
    middle = len(payload) // 2
    return payload[:middle] + bytes([payload[middle] ^ 0xFF]) + payload[middle + 1 :]


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (_tampered, "sha256"),
        (lambda payload: payload[:-100], "truncated"),
        (lambda payload: payload + b"\0", "too long"),
    ],
    ids=["tampered", "truncated", "extended"],
)
def test_load_refuses_damaged_weights(store, raw, adapter_name, spec, code_weights, corrupt, match):
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    raw.write_weights(adapter_name, 1, corrupt(raw.read_weights(adapter_name, 1)))
    with pytest.raises(VersionIntegrityError, match=match):
        store.load(adapter_name, 1, expected_base_model_hash=spec.base_model_hash)


def _replace_weights_and_fix_manifest(store, raw, name, payload):
    """An attacker who can write both files: new weights, and a manifest that vouches for them."""
    manifest = json.loads(store.manifest(name, 1).to_json())
    manifest["weights_sha256"] = hashlib.sha256(payload).hexdigest()
    manifest["num_weight_bytes"] = len(payload)
    raw.write_weights(name, 1, payload)
    raw.write_manifest(name, 1, json.dumps(manifest).encode())


def test_load_refuses_a_pickle_disguised_as_safetensors(
    store, raw, adapter_name, spec, code_weights
):
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    pickled = pickle.dumps({key: value.numpy() for key, value in code_weights.items()})
    _replace_weights_and_fix_manifest(store, raw, adapter_name, pickled)
    with pytest.raises(VersionIntegrityError, match="not a safetensors file"):
        store.load(adapter_name, 1, expected_base_model_hash=spec.base_model_hash)


def test_load_refuses_a_truncated_file_even_with_a_matching_manifest(
    store, raw, adapter_name, spec, code_weights
):
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    _replace_weights_and_fix_manifest(
        store, raw, adapter_name, raw.read_weights(adapter_name, 1)[:-64]
    )
    with pytest.raises(VersionIntegrityError, match="safetensors"):
        store.load(adapter_name, 1, expected_base_model_hash=spec.base_model_hash)


def test_load_refuses_a_foreign_base_model(store, adapter_name, spec, code_weights):
    from osd.adapters.lora import base_model_hash

    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    foreign = base_model_hash(tiny_base(seed=7))
    with pytest.raises(VersionIntegrityError, match="not this base model"):
        store.load(adapter_name, 1, expected_base_model_hash=foreign)


def test_load_refuses_weights_shaped_for_another_layout(store, adapter_name, spec, code_weights):
    from osd.testing import with_lora_adapters

    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    rank8 = with_lora_adapters(tiny_base(), ["wide"], seed=2, rank=8)
    with pytest.raises(VersionIntegrityError, match="expected \\(8, 32\\)"):
        store.load(
            adapter_name,
            1,
            expected_base_model_hash=spec.base_model_hash,
            expected_shapes=lora_shapes(rank8, "wide"),
        )
    missing_one = dict(list(lora_shapes(rank8, "wide").items())[:2])
    with pytest.raises(VersionIntegrityError, match="unexpected"):
        store.load(adapter_name, 1, expected_base_model_hash=None, expected_shapes=missing_one)


def test_load_refuses_a_manifest_copied_from_another_version(
    store, raw, adapter_name, spec, code_weights
):
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    store.publish(adapter_name, code_weights, spec=spec, expected_current=1)
    raw.write_manifest(adapter_name, 2, store.manifest(adapter_name, 1).to_json())
    with pytest.raises(VersionIntegrityError, match="describes .* v1"):
        store.load(adapter_name, 2, expected_base_model_hash=None)


def test_publish_refuses_weights_of_another_rank(store, adapter_name, spec, code_weights):
    from dataclasses import replace

    with pytest.raises(VersionIntegrityError, match="rank-8"):
        store.publish(adapter_name, code_weights, spec=replace(spec, rank=8), expected_current=None)
    assert store.current(adapter_name) is None


def test_publish_refuses_non_finite_weights(store, adapter_name, spec, code_weights):
    bad = dict(code_weights)
    key = sorted(bad)[0]
    bad[key] = bad[key].clone()
    bad[key][0, 0] = float("nan")
    with pytest.raises(VersionIntegrityError, match="NaN"):
        store.publish(adapter_name, bad, spec=spec, expected_current=None)


def test_adapters_over_max_bytes_are_refused(
    backend, tmp_path, request, adapter_name, spec, code_weights
):
    small = make_store(backend, tmp_path, request, max_bytes=1000)
    with pytest.raises(VersionTooLarge, match="over max_bytes 1000"):
        small.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    assert small.current(adapter_name) is None
    make_store(backend, tmp_path, request).publish(
        adapter_name, code_weights, spec=spec, expected_current=None
    )
    with pytest.raises(VersionTooLarge):
        small.load(adapter_name, 1, expected_base_model_hash=None)


def test_rollback_moves_the_pointer_back_with_compare_and_set(
    store, adapter_name, spec, code_weights
):
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    store.publish(adapter_name, code_weights, spec=spec, expected_current=1)
    store.rollback(adapter_name, 1, expected_current=2)
    assert store.current(adapter_name) == 1
    with pytest.raises(PublishConflict):
        store.rollback(adapter_name, 2, expected_current=2)
    with pytest.raises(VersionNotFound):
        store.rollback(adapter_name, 9, expected_current=1)
    assert store.current(adapter_name) == 1
    # A trainer that still believes version 2 is current cannot publish over the rollback.
    with pytest.raises(PublishConflict):
        store.publish(adapter_name, code_weights, spec=spec, expected_current=2)


def test_rollback_to_the_base_draft_points_at_version_0_and_publishing_goes_on_from_it(
    store, other_store, adapter_name, spec, code_weights
):
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    with other_store.subscribe() as subscription:
        store.rollback(adapter_name, BASE_VERSION, expected_current=1)
        assert _next_event_for(subscription, adapter_name) == PointerEvent(adapter_name, 0)
    assert store.current(adapter_name) == BASE_VERSION
    assert store.list_versions(adapter_name) == [1]  # nothing stored for the base draft
    with pytest.raises(PublishConflict):  # a trainer still on v1 learns of the rollback
        store.publish(adapter_name, code_weights, spec=spec, expected_current=1)
    manifest = store.publish(adapter_name, code_weights, spec=spec, expected_current=BASE_VERSION)
    assert store.current(adapter_name) == manifest.version == 3
    assert manifest.parent_version is None  # trained from the base draft
    with pytest.raises(PublishConflict):
        store.rollback(adapter_name, BASE_VERSION, expected_current=1)
    with pytest.raises(ValueError):
        store.rollback(adapter_name, -1, expected_current=3)


def test_subscriber_hears_publish_and_rollback(
    store, other_store, adapter_name, spec, code_weights
):
    with other_store.subscribe() as subscription:
        store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
        assert _next_event_for(subscription, adapter_name) == PointerEvent(adapter_name, 1)
        store.publish(adapter_name, code_weights, spec=spec, expected_current=1)
        assert _next_event_for(subscription, adapter_name) == PointerEvent(adapter_name, 2)
        store.rollback(adapter_name, 1, expected_current=2)
        assert _next_event_for(subscription, adapter_name) == PointerEvent(adapter_name, 1)
        assert _next_event_for(subscription, adapter_name, timeout_s=0.1) is None


def _next_event_for(subscription, name, timeout_s=5.0):
    """Events for other names (other tests on the shared Redis) are skipped."""
    while (event := subscription.get(timeout_s)) is not None:
        if event.name == name:
            return event
    return None


def test_redis_notification_is_json_name_and_version_on_osd_adapters(
    redis_url, adapter_name, spec, code_weights
):
    import redis as redis_py

    store = open_adapter_store(redis_url)
    client = redis_py.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe("osd:adapters")
    received = []
    try:
        assert pubsub.get_message(timeout=5)["type"] == "subscribe"
        store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
        while (message := pubsub.get_message(timeout=5)) is not None:
            received.append(json.loads(message["data"]))
            if received[-1]["name"] == adapter_name:
                break
        assert received[-1] == {"name": adapter_name, "version": 1}
    finally:
        pubsub.close()
        client.close()
        store.close()


def test_changed_pointers_reports_what_a_replica_missed(store, adapter_name, spec, code_weights):
    # Other tests share the Redis: start from what is there now.
    known = {name: store.current(name) for name in store.names()}
    assert store.changed_pointers(known) == []
    assert store.changed_pointers({**known, adapter_name: None}) == []
    store.publish(adapter_name, code_weights, spec=spec, expected_current=None)
    assert store.changed_pointers(known) == [PointerEvent(adapter_name, 1)]
    assert store.changed_pointers({**known, adapter_name: 1}) == []
    assert store.changed_pointers({**known, adapter_name: 5}) == [PointerEvent(adapter_name, 1)]


def test_open_adapter_store_picks_the_backend_by_location(tmp_path, redis_url):
    assert isinstance(open_adapter_store(tmp_path / "a"), DirectoryStore)
    store = open_adapter_store(redis_url)
    assert isinstance(store, RedisStore)
    store.close()


@pytest.mark.parametrize("name", ["", "a:b", "../x", "a/b", ".hidden", "x" * 65, 7])
def test_bad_adapter_names_are_refused(store, name, spec, code_weights):
    with pytest.raises(ValueError, match="adapter name"):
        store.publish(name, code_weights, spec=spec, expected_current=None)
