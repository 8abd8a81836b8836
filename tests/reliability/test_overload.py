"""Overload of a Ray-free replica: concurrency far above its admission limit is refused at once
with OpenAI-style 429s, admitted requests keep a bounded latency, no admission slot leaks, and
the process's memory stays flat across rounds. docs/reliability.md, row "overload (replica)".
"""

from __future__ import annotations

import asyncio
import time

import httpx

from .conftest import completion, metric, percentile, rss_bytes, running_replica, toy_config

CAPACITY = 4  # serve.max_ongoing_requests
BURST = 200  # concurrent requests per round: 50x capacity
ROUNDS, WARMUP = 8, 2


async def burst(app, size: int) -> list[tuple[int, float, dict]]:
    """`size` requests at once; (status, seconds, body) each."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:

        async def one() -> tuple[int, float, dict]:
            start = time.perf_counter()
            response = await client.post("/v1/completions", json=completion(), timeout=60)
            return response.status_code, time.perf_counter() - start, response.json()

        return await asyncio.wait_for(asyncio.gather(*[one() for _ in range(size)]), 120)


def test_overload_is_refused_with_429_at_once_and_memory_stays_flat():
    config = toy_config(f"serve.max_ongoing_requests={CAPACITY}")
    with running_replica(config) as replica:
        app = replica.client.app
        admitted, refused, rss = [], [], []
        for _ in range(ROUNDS):
            outcomes = asyncio.run(burst(app, BURST))
            assert {status for status, _, _ in outcomes} <= {200, 429}, outcomes[:3]
            admitted += [s for status, s, _ in outcomes if status == 200]
            refused += [(s, body) for status, s, body in outcomes if status == 429]
            rss.append(rss_bytes())
        in_flight = metric(replica.metrics(), "osd_requests_in_flight")
        # Every slot came back: CAPACITY requests at once are all admitted again.
        after = asyncio.run(burst(app, CAPACITY))

    growth = rss[-1] / rss[WARMUP - 1] - 1
    print(
        f"\n[overload asgi] {ROUNDS} rounds of {BURST} at capacity {CAPACITY}: admitted "
        f"{len(admitted)}, refused {len(refused)}; refusal p50 "
        f"{percentile([s for s, _ in refused], 0.5) * 1e3:.0f} ms max "
        f"{max(s for s, _ in refused) * 1e3:.0f} ms; admitted p50 "
        f"{percentile(admitted, 0.5) * 1e3:.0f} ms p99 {percentile(admitted, 0.99) * 1e3:.0f} "
        f"ms; RSS MiB per round {[round(r / 2**20) for r in rss]} (growth after warm-up "
        f"{growth:+.1%})"
    )
    assert len(admitted) >= ROUNDS * CAPACITY
    assert len(refused) >= ROUNDS * (BURST - 2 * CAPACITY)
    error = refused[0][1]["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
    assert max(s for s, _ in refused) < 2.0  # refused without waiting for a slot
    assert percentile(admitted, 0.99) < 5.0  # toy requests of 8 tokens take ~50 ms alone
    assert in_flight == 0
    assert [status for status, _, _ in after] == [200] * CAPACITY
    assert growth < 0.15
