"""Overload and a killed replica (runs last: it kills the app's only replica)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


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
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        statuses = [f.result()[0] for f in in_flight]
    assert len(statuses) == 3  # in-flight requests may fail; none hangs
    deadline = time.perf_counter() + 120
    while time.perf_counter() < deadline:
        status, _ = post(base_url, 5, timeout=30)
        if status == 200:
            break
        time.sleep(1.0)
    assert status == 200, status
    new_pid = httpx.get(f"{base_url}/health", timeout=10).json()["pid"]
    assert new_pid != pid
