"""Overload and a killed replica (runs last: it kills the app's only replica)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.reliability.conftest import wait_for


def post(base_url, max_tokens, timeout=120):
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


def test_overload_is_refused_quickly_and_admitted_requests_finish(ray_serve_app):
    base_url, config = ray_serve_app
    capacity = config.serve.max_ongoing_requests + config.serve.max_queued_requests
    with ThreadPoolExecutor(max_workers=3 * capacity) as pool:
        outcomes = list(pool.map(lambda _: post(base_url, 120), range(3 * capacity)))
    refused = [t for status, t in outcomes if status in (429, 503)]
    served = [t for status, t in outcomes if status == 200]
    others = [status for status, _ in outcomes if status not in (200, 429, 503)]
    print(
        f"served {len(served)}, refused {len(refused)}, max refusal {max(refused):.2f}s, "
        f"p99-ish served latency {sorted(served)[int(0.99 * (len(served) - 1))]:.2f}s"
    )
    assert others == []
    assert len(refused) >= capacity // 2
    assert len(served) >= config.serve.max_ongoing_requests
    assert max(refused) < 10.0  # refused without waiting for a slot (2 busy cores here)


def test_killed_replica_is_replaced_and_serving_resumes(ray_serve_app):
    base_url, _ = ray_serve_app
    pid = httpx.get(f"{base_url}/health", timeout=10).json()["pid"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        in_flight = [pool.submit(post, base_url, 150) for _ in range(3)]
        wait_for(lambda: in_flight_requests(base_url) >= 1, timeout_s=60)  # killed mid-request
        os.kill(pid, signal.SIGKILL)
        statuses = [f.result()[0] for f in in_flight]
    # The requests in flight end, served or with an error, none with the client's timeout (a
    # hang) and none with a 4xx (the client did nothing wrong).
    assert not [s for s in statuses if isinstance(s, str) and "Timeout" in s], statuses
    assert not [s for s in statuses if isinstance(s, int) and 400 <= s < 500], statuses
    wait_for(lambda: post(base_url, 5, timeout=30)[0] == 200, timeout_s=120, interval_s=1.0)
    new_pid = httpx.get(f"{base_url}/health", timeout=10).json()["pid"]
    assert new_pid != pid
