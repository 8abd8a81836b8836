"""Overload and a killed replica, on a Serve app of this module's own.

Killing the replica and flooding its queue damages the app for a while, so these tests deploy
their own (``serve_app`` under ``/faults``, deleted at the end of the module) rather than use
the session's shared one: they may run in any order, and the tests after them get an app that
was never harmed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.reliability.conftest import wait_for
from tests.serving.conftest import serve_app


@pytest.fixture(scope="module")
def faults_app(serve_port, serving_redis):
    """This module's own Serve app: (base_url, config)."""
    with serve_app(serve_port, serving_redis.url, "osd-faults", route_prefix="/faults") as app:
        yield app


TOY_EOS = "1"  # the toy tokenizer's <eos> id (osd/toy_models.py)


def post(base_url, max_tokens, timeout=120, bias=None):
    start = time.perf_counter()
    try:
        response = httpx.post(
            f"{base_url}/v1/completions",
            timeout=timeout,
            json={
                "model": "osd",
                "prompt": "the cat",
                "max_tokens": max_tokens,
                "temperature": 0.7,
                "log": False,
                **({"logit_bias": bias} if bias else {}),
            },
        )
        if response.status_code == 500:
            print("500 body:", response.text[:500])
        return response.status_code, time.perf_counter() - start
    except httpx.HTTPError as exc:
        return repr(exc), time.perf_counter() - start


def in_flight_requests(base_url):
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("osd_requests_in_flight")
    )


def test_overload_is_refused_and_admitted_requests_finish(faults_app):
    base_url, config = faults_app
    capacity = config.serve.max_ongoing_requests + config.serve.max_queued_requests
    with ThreadPoolExecutor(max_workers=3 * capacity) as pool:
        outcomes = list(pool.map(lambda _: post(base_url, 120), range(3 * capacity)))
    refused = [t for status, t in outcomes if status in (429, 503)]
    served = [t for status, t in outcomes if status == 200]
    others = [status for status, _ in outcomes if status not in (200, 429, 503)]
    # Latencies for a reader only: how fast a refusal is belongs in bench/, not in a test.
    print(f"served {len(served)} (max {max(served, default=0):.2f}s), refused {len(refused)}")
    assert others == []  # every request served or refused with a retryable status, none failed
    assert len(refused) >= capacity // 2  # three times the capacity at once: many are turned away
    assert len(served) >= config.serve.max_ongoing_requests


def test_killed_replica_is_replaced_and_serving_resumes(faults_app):
    base_url, _ = faults_app
    pid = httpx.get(f"{base_url}/health", timeout=10).json()["pid"]
    # Clients keep posting until the kill, each request banned from ending early at <eos>, so
    # the kill lands mid-request however fast the toy model decodes (three one-shot requests
    # could all end between two scrapes of /metrics on a slow machine).
    killed = threading.Event()

    def keep_posting():
        outcomes = []
        while not killed.is_set():
            outcomes.append(post(base_url, 150, bias={TOY_EOS: -100}))
        return outcomes

    with ThreadPoolExecutor(max_workers=3) as pool:
        clients = [pool.submit(keep_posting) for _ in range(3)]
        try:
            wait_for(lambda: in_flight_requests(base_url) >= 1, timeout_s=60)
            os.kill(pid, signal.SIGKILL)
        finally:
            killed.set()
        outcomes = [outcome for client in clients for outcome in client.result()]
    statuses = [status for status, _ in outcomes]
    # The requests in flight end, served or with an error, none with the client's timeout (a
    # hang) and none with a 4xx (the client did nothing wrong).
    assert not [s for s in statuses if isinstance(s, str) and "Timeout" in s], statuses
    assert not [s for s in statuses if isinstance(s, int) and 400 <= s < 500], statuses
    wait_for(lambda: post(base_url, 5, timeout=30)[0] == 200, timeout_s=120, interval_s=1.0)
    replaced = httpx.get(f"{base_url}/health", timeout=10).json()
    assert replaced["pid"] != pid
    assert replaced["adapters"].keys() == {"general", "code"}  # a whole replica again
