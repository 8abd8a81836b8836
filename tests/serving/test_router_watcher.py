"""The version watcher (serving.watcher) with the router's trial (serving.router_trial): a
replica follows the published routing model, refuses a bad one, and rolls back one its
requests do worse with; against a real redis-server."""

from __future__ import annotations

import uuid
from collections import deque

import numpy as np
import pytest

from osd.buffer.redis_server import connect
from osd.routing import fit_routing_model, stack_features
from osd.routing.store import open_routing_store
from osd.versions.errors import BASE_VERSION
from serving.live_monitor import LiveMonitor
from serving.router import ROUTER_MONITOR_KEY, AdapterRouter
from serving.router_trial import RouterTrial
from serving.watcher import VersionWatcher

CODE, PROSE = [1, 2, 3, 4], [40, 41, 42, 43]


def model_to(adapter: str):
    """A routing model that sends CODE prompts to `adapter` and PROSE to general."""
    features = stack_features([CODE] * 4 + [PROSE] * 4)
    return fit_routing_model(features, [adapter] * 4 + ["general"] * 4, ["general", adapter])


class Publisher:
    """The trainer's side of one routing model's versions, for the tests."""

    def __init__(self, url: str, name: str) -> None:
        self.store, self.name = open_routing_store(url), name

    def publish(self, model, *, expected_current, score) -> int:
        return self.store.publish(
            self.name, model, expected_current=expected_current, score=score
        ).version

    def current(self):
        return self.store.current(self.name)

    def rollback(self, to_version, *, expected_current) -> None:
        self.store.rollback(self.name, to_version, expected_current=expected_current)

    def key(self, version: int) -> str:
        return f"osd:router:{self.name}:v{version}:model"


@pytest.fixture
def parts(serving_redis):
    name = f"test-{uuid.uuid4().hex[:8]}"
    store = Publisher(serving_redis.url, name)
    router = AdapterRouter(["general", "code", "sql"], epsilon=0.0)
    monitor = LiveMonitor(window=100, margin=0.05)
    events: deque = deque(maxlen=50)
    trial = RouterTrial(router, monitor, trial_share=0.2, name=name)
    watcher = VersionWatcher(open_routing_store(serving_redis.url), trial, events=events)
    yield store, router, monitor, events, watcher
    watcher.stop()
    watcher.store.close()
    store.store.close()


def serve(monitor: LiveMonitor, version: int, rate: float, requests: int = 10) -> None:
    """Feeds the monitor `requests` requests of 20 drafted tokens at acceptance `rate`."""
    for _ in range(requests):
        monitor.observe(ROUTER_MONITOR_KEY, version, int(rate * 20), 20)


def test_a_published_model_routes_the_next_request(parts):
    store, router, _, events, watcher = parts
    watcher.reconcile()
    assert router.choose(prompt_ids=CODE).router_version == 0  # nothing published yet
    version = store.publish(model_to("code"), expected_current=None, score=0.5)
    watcher.reconcile()
    decision = router.choose(prompt_ids=CODE)
    assert (decision.adapter, decision.reason, decision.router_version) == (
        "code",
        "content",
        version,
    )
    assert events[-1]["event"] == "swap" and events[-1]["adapter"] == "router"


def test_a_corrupt_version_is_refused_and_the_current_one_stays(parts, serving_redis):
    store, router, _, events, watcher = parts
    good = store.publish(model_to("code"), expected_current=None, score=0.5)
    watcher.reconcile()
    bad = store.publish(model_to("sql"), expected_current=good, score=0.6)
    connect(serving_redis.url).set(store.key(bad), b"\x80\x04 not it")
    watcher.reconcile()
    watcher.reconcile()  # refused once, never fetched again
    assert router.choose(prompt_ids=CODE).adapter == "code"
    assert [e["event"] for e in events] == ["swap", "refused"]


def test_a_new_version_is_on_trial_against_its_predecessor_on_the_same_traffic(parts):
    store, router, monitor, events, watcher = parts
    first = store.publish(model_to("code"), expected_current=None, score=0.5)
    watcher.reconcile()
    # During the trial a share of the requests is still routed by the predecessor (no model).
    versions = {router.choose(prompt_ids=CODE).router_version for _ in range(200)}
    assert versions == {0, first}
    serve(monitor, first, 0.7)
    serve(monitor, 0, 0.7)
    watcher.reconcile()  # both windows full, not worse: kept, the trial ends
    assert events[-1]["event"] == "kept" and watcher.holder.previous is None
    assert {router.choose(prompt_ids=CODE).router_version for _ in range(50)} == {first}


def test_a_version_whose_requests_do_worse_is_rolled_back_in_the_store_too(parts):
    store, router, monitor, events, watcher = parts
    first = store.publish(model_to("code"), expected_current=None, score=0.5)
    watcher.reconcile()
    serve(monitor, first, 0.7)  # what it did before the trial does not count
    second = store.publish(model_to("sql"), expected_current=first, score=0.6)
    watcher.reconcile()
    assert router.choose(prompt_ids=CODE).adapter in {"sql", "code"}
    serve(monitor, second, 0.2)
    watcher.reconcile()
    assert store.current() == second  # the predecessor has no window in this trial yet
    serve(monitor, first, 0.7)
    watcher.reconcile()
    assert store.current() == first
    assert router.choose(prompt_ids=CODE).adapter == "code"
    assert events[-1]["event"] == "rollback" and events[-1]["to_version"] == first
    watcher.reconcile()  # the rolled-back version is never taken again
    assert {router.choose(prompt_ids=CODE).router_version for _ in range(50)} == {first}


def test_a_pointer_moved_back_elsewhere_is_followed_without_a_trial(parts):
    store, router, _, _, watcher = parts
    first = store.publish(model_to("code"), expected_current=None, score=0.5)
    second = store.publish(model_to("sql"), expected_current=first, score=0.6)
    watcher.reconcile()
    store.rollback(first, expected_current=second)  # another replica judged `second` worse
    watcher.reconcile()
    assert watcher.holder.previous is None  # the version rolled back elsewhere routes nothing here
    assert {router.choose(prompt_ids=CODE).router_version for _ in range(50)} == {first}


def test_the_watcher_thread_picks_up_versions_and_stops(parts):
    store, router, _, _, watcher = parts
    watcher.interval = 0.05
    watcher.start()
    try:
        version = store.publish(model_to("code"), expected_current=None, score=0.5)
        for _ in range(100):
            if router.choose(prompt_ids=CODE).router_version == version:
                break
            watcher._stop.wait(0.05)
        assert router.choose(prompt_ids=CODE).adapter == "code"
    finally:
        watcher.stop()
    assert not watcher.alive


def test_store_keeps_a_bounded_history_but_never_a_version_a_replica_holds(parts):
    store, _, _, _, watcher = parts
    current = None
    for _ in range(3):
        current = store.publish(model_to("code"), expected_current=current, score=0.5)
    watcher.reconcile()  # serves v3 on trial against no model; reports holding v3
    for _ in range(3):
        current = store.publish(model_to("code"), expected_current=current, score=0.5)
    name = store.name
    deleted = store.store.collect_garbage(name, keep_versions=2, grace_s=0.0)
    assert deleted == [1, 2]  # v3 is held by the replica, v4-v5 kept, v6 current
    assert store.store.list_versions(name) == [3, 4, 5, 6]
    _, model = store.store.load(name, 6)
    assert np.array_equal(model.weights, model_to("code").weights)


def test_a_rollback_past_the_first_version_routes_by_no_model(parts):
    store, router, monitor, events, watcher = parts
    first = store.publish(model_to("code"), expected_current=None, score=0.5)
    watcher.reconcile()
    serve(monitor, first, 0.1)
    serve(monitor, BASE_VERSION, 0.8)
    watcher.reconcile()
    assert store.current() == BASE_VERSION
    assert events[-1]["event"] == "rollback" and events[-1]["to_version"] == BASE_VERSION
    assert {router.choose(prompt_ids=CODE).router_version for _ in range(20)} == {BASE_VERSION}
