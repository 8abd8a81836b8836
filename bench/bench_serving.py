"""Load generator for the Serve app: speculation on vs off, logging on vs off.

Starts a local redis-server, a local Ray and the app (toy models by default; pass overrides such
as ``model.target=demo:target model.draft=demo:draft`` for the demo pair), then drives
streaming ``/v1/completions`` at concurrency 1, 4 and 16 and prints requests/s, tokens/s and
p50/p99 time to first token and latency for: speculative decoding (block, k=4) with logging on
and off, and speculation off (``spec.method=none``: plain target decoding through the same app).
Run: ``python -m bench.bench_serving``.

``--proposers``: who drafts, through HTTP, on the demo pair (pass ``model.target=demo:target
model.draft=demo:draft``): the target alone, the draft model alone (``spec.proposer: draft``),
suffix decoding alone and the default ``auto`` (k chosen by the controller), on the repetitive
traffic of ``bench/bench_proposers.py``. One app serves every variant, so its suffix store
holds what the earlier variants' requests said (as a serving replica's does).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from typing import Any

import httpx

from bench.clients import run_clients
from osd.buffer.redis_server import LocalRedis
from osd.config import load_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_prompts(domain: str, count: int) -> list[str]:
    """Held-out prompts of one domain of the demo corpus (the demo pair must be built)."""
    from osd.demo import build_demo_models, heldout_prompts

    return heldout_prompts(build_demo_models().corpus, [domain])[domain][:count]


def one_request(url: str, body: dict[str, Any]) -> tuple[float, float, int]:
    """(time to first token, latency, completion tokens) of one streamed completion."""
    start = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", url, json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and first is None:
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return first or 0.0, time.perf_counter() - start, tokens


def run_load(
    url: str, body: dict[str, Any], concurrency: int, requests: int, prompts: list[str]
) -> dict[str, float]:
    results: list[tuple[float, float, int]] = []
    errors: list[str] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                outcome = one_request(url, {**body, "prompt": prompts[i % len(prompts)]})
            except httpx.HTTPError as e:
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                results.append(outcome)

    elapsed = run_clients(concurrency, worker)
    if errors:
        print(f"  {len(errors)} of {requests} requests failed, e.g. {errors[0]}")
    if not results:
        raise RuntimeError(f"every request failed: {errors[:3]}")
    ttft = sorted(r[0] for r in results)
    latency = sorted(r[1] for r in results)

    def p99(xs: list[float]) -> float:
        return xs[min(len(xs) - 1, int(0.99 * len(xs)))]

    return {
        "req/s": len(results) / elapsed,
        "tok/s": sum(r[2] for r in results) / elapsed,
        "ttft p50": statistics.median(ttft),
        "ttft p99": p99(ttft),
        "lat p50": statistics.median(latency),
        "lat p99": p99(latency),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve app load generator")
    parser.add_argument("--config", default=None)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--domain",
        default="prose",
        help="with the demo pair: held-out prompts of this domain (the base draft's is prose)",
    )
    parser.add_argument(
        "--proposers", action="store_true", help="who drafts, on repetitive traffic (demo pair)"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    overrides = args.overrides or ["model.target=toy:target", "model.draft=toy:draft"]
    port = free_port()
    config = load_config(
        args.config,
        [
            *overrides,
            f"serve.port={port}",
            "serve.max_ongoing_requests=16",
            "serve.max_queued_requests=64",
        ],
    )
    import ray
    from ray import serve

    from serving.app import build_app

    with LocalRedis() as redis_server:
        ray.init(include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config, redis_server.url), name="osd", route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/completions"
        demo = config.model.target.startswith("demo:")
        prompts = demo_prompts(args.domain, 64) if demo else ["the cat sat on the mat and"]
        if args.proposers:
            from bench.bench_proposers import repetitive_prompts
            from osd.demo import build_demo_models

            prompts = repetitive_prompts(build_demo_models().corpus, max(args.requests, 48))
        base = {
            "model": config.serve.model_name,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        variants = {
            "speculative (block, k=4), logging on": {"spec": {"method": "block", "k": 4}},
            "speculative (block, k=4), logging off": {
                "spec": {"method": "block", "k": 4},
                "log": False,
            },
            "speculation off (target only), logging on": {"spec": {"method": "none"}},
        }
        if args.proposers:
            variants = {
                "target alone": {"spec": {"method": "none"}, "log": False},
                "draft model (k auto)": {
                    "spec": {"method": "block", "k": "auto", "proposer": "draft"},
                    "log": False,
                },
                "suffix": {
                    "spec": {"method": "block", "k": "auto", "proposer": "suffix"},
                    "log": False,
                },
                "auto (the default)": {"spec": {"method": "block", "k": "auto"}, "log": False},
            }
        run_load(url, base, 1, 2, prompts)  # warm-up
        print(
            f"{'variant':<40}{'conc':>5}"
            + "".join(
                f"{h:>10}" for h in ("req/s", "tok/s", "ttft p50", "ttft p99", "lat p50", "lat p99")
            )
        )
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            for name, extra in variants.items():
                row = run_load(url, {**base, **extra}, concurrency, args.requests, prompts)
                print(f"{name:<40}{concurrency:>5}" + "".join(f"{v:>10.3f}" for v in row.values()))
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
