"""Clients that go away mid-request, against a replica behind a real HTTP server (uvicorn, as in
production; Starlette's TestClient never disconnects). Each abandoned request must give back its
admission slot and adapter lease once its thread has stopped decoding. Before the fix, every
stream abandoned before its first chunk kept its slot forever, and a replica ended up refusing
everything with 429. docs/reliability.md, row "clients disconnect".
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from serving.api import create_api
from serving.runtime import ReplicaRuntime

from .conftest import (
    completion,
    free_port,
    metric,
    running_replica,
    send_and_hang_up,
    toy_config,
    wait_for,
)

CAPACITY = 4  # serve.max_ongoing_requests


@contextmanager
def http_server(runtime: ReplicaRuntime) -> Iterator[str]:
    """The replica's app on a free local port (uvicorn in a thread); yields the base URL."""
    port = free_port()
    config = uvicorn.Config(create_api(runtime), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout_s=30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_abandoned_requests_give_back_their_slots_and_leases():
    config = toy_config(f"serve.max_ongoing_requests={CAPACITY}", "serve.max_tokens_limit=200")
    with running_replica(config) as replica, http_server(replica.runtime) as base_url:
        runtime = replica.runtime
        long = completion(max_tokens=200, temperature=0)
        kinds = [
            ({**long, "stream": True}, 0),  # gone before the first chunk
            ({**long, "stream": True}, 64),  # gone after the first bytes
            ({**long, "stream": False}, 0),  # gone while it decodes
        ]
        for _ in range(3):  # 9 abandoned requests: more than the 4 slots there are
            for body, read_bytes in kinds:
                send_and_hang_up(base_url, body, read_bytes)

        def all_given_back() -> bool:
            # Both: a request takes its adapter lease before it counts as in flight, so the
            # gauge alone can read 0 while the last hung-up request is still being admitted.
            text = runtime.metrics_text().decode()
            in_flight = metric(text, "osd_requests_in_flight")
            return in_flight == 0 and runtime.slots.leased() == {}

        wait_for(all_given_back, timeout_s=60, interval_s=0.1)
        assert runtime.slots.leased() == {}

        # Every slot is free again: CAPACITY requests at once are all served.
        with httpx.Client(base_url=base_url, timeout=60) as client:
            statuses: list[int] = []

            def one() -> None:
                response = client.post("/v1/completions", json=completion(max_tokens=4))
                statuses.append(response.status_code)

            threads = [threading.Thread(target=one) for _ in range(CAPACITY)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
        assert statuses == [200] * CAPACITY, statuses


def test_a_whole_answer_stops_decoding_when_its_client_hangs_up():
    """A client that times out on a whole (not streamed) answer and closes its connection: its
    rows stop at their next step, they do not decode the rest of max_tokens for nobody
    (OpenAI clients retry a timed-out request, so each would otherwise run twice more)."""
    config = toy_config("serve.max_ongoing_requests=4", "serve.max_tokens_limit=400")
    with running_replica(config) as replica, http_server(replica.runtime) as base_url:
        runtime = replica.runtime
        before = metric(runtime.metrics_text().decode(), "vllm:generation_tokens_total")
        for _ in range(3):
            send_and_hang_up(base_url, completion(max_tokens=400, temperature=0))
        wait_for(
            lambda: metric(runtime.metrics_text().decode(), "osd_requests_in_flight") == 0,
            timeout_s=60,
            interval_s=0.05,
        )
        generated = metric(runtime.metrics_text().decode(), "vllm:generation_tokens_total")
        assert generated - before < 3 * 400 / 2, generated - before


def test_a_list_of_prompts_gives_back_every_prompts_slot_however_it_is_abandoned():
    config = toy_config(f"serve.max_ongoing_requests={CAPACITY}", "serve.max_tokens_limit=200")
    with running_replica(config) as replica, http_server(replica.runtime) as base_url:
        runtime = replica.runtime
        several = completion(max_tokens=200, temperature=0, prompt=["the cat", "a dog", "hi"])

        def handled() -> float:  # counted when the handler returns (a stream: at its start)
            text = runtime.metrics_text().decode()
            return sum(  # served, or left by its client (499)
                metric(text, "osd_requests_total", endpoint="/v1/completions", status=status)
                for status in ("200", "499")
            )

        for stream, read_bytes in ((True, 0), (True, 64), (False, 0)):
            before = handled()
            send_and_hang_up(base_url, {**several, "stream": stream}, read_bytes)

            def given_back(before: float = before) -> bool:
                text = runtime.metrics_text().decode()
                return (
                    handled() > before
                    and metric(text, "osd_requests_in_flight") == 0
                    and runtime.slots.leased() == {}
                )

            wait_for(given_back, timeout_s=60, interval_s=0.1)
