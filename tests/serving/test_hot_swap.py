"""Hot-swap under load: versions published while clients stream; a bad one is rolled back."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import torch

from osd.adapter_lora import adapter_spec, lora_state_dict
from osd.adapter_store import open_adapter_store
from osd.model_sources import attach_lora_adapters, load_model_pair


def replica_shaped_weights(config):
    """(spec, identity weights, harmful weights) for the replicas' 'general' adapter."""
    _, draft, _ = load_model_pair(config.model)
    peft = attach_lora_adapters(draft, config.model, ["general@0", "code@0"])
    spec = adapter_spec(peft, "general@0", base_model_id=config.model.draft)
    identity = lora_state_dict(peft, "general@0")  # B = 0: the base draft exactly
    gen = torch.Generator().manual_seed(0)
    harmful = {
        key: torch.randn(value.shape, generator=gen) * (3.0 if "lora_B" in key else 1.0)
        for key, value in identity.items()
    }
    return spec, identity, harmful


def stream_forever(base_url, stop, failures, gaps, completed):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    while not stop.is_set():
        try:
            stream = client.completions.create(
                model="osd",
                prompt="the cat sat",
                max_tokens=24,
                temperature=0,
                stream=True,
                extra_body={"draft": "general"},
            )
            last = time.perf_counter()
            for _ in stream:
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            completed.append(1)
        except Exception as exc:  # noqa: BLE001 - every failure is counted and asserted on
            failures.append(repr(exc))


def wait_for_version(base_url, version, timeout_s):
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if httpx.get(f"{base_url}/health", timeout=5).json()["adapters"]["general"] == version:
            return time.perf_counter() - start
        time.sleep(0.05)
    return None


def wait_for_requests(completed, count, timeout_s=60):
    deadline = time.perf_counter() + timeout_s
    while len(completed) < count and time.perf_counter() < deadline:
        time.sleep(0.1)


def test_versions_swap_in_under_load_and_a_bad_one_is_rolled_back(ray_serve_app, serving_redis):
    base_url, config = ray_serve_app
    store = open_adapter_store(serving_redis.url)
    spec, identity, harmful = replica_shaped_weights(config)
    stop, failures, gaps, completed = threading.Event(), [], [], []
    clients = [
        threading.Thread(target=stream_forever, args=(base_url, stop, failures, gaps, completed))
        for _ in range(2)
    ]
    for thread in clients:
        thread.start()
    try:
        # The live monitor compares each version with its predecessor's last window: let this
        # test's own traffic fill the window of the version in place first (the session's app
        # served other tests' prompts before), or a version identical to it may be rolled back
        # for the change of traffic alone.
        wait_for_requests(completed, 4)
        delays = []
        current = store.current("general")
        for _ in range(5):
            manifest = store.publish("general", identity, spec, expected_current=current)
            current = manifest.version
            delays.append(wait_for_version(base_url, current, timeout_s=10))
            time.sleep(0.5)
        good = current
        # A full window of live acceptance for the last good version (40 drafted tokens; a
        # request drafts about 24): otherwise it is unproven and no baseline for the next one.
        wait_for_requests(completed, len(completed) + 4)
        bad = store.publish("general", harmful, spec, expected_current=good).version
        rolled_back = None
        for _ in range(600):  # it may be swapped in and rolled back between two looks
            events = httpx.get(f"{base_url}/health", timeout=5).json()["adapter_events"]
            seen = {(e["event"], e["version"]) for e in events}
            if ("swap", bad) in seen and ("rollback", bad) in seen:
                rolled_back = wait_for_version(base_url, good, timeout_s=5)
                break
            time.sleep(0.1)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=120)
    print(
        f"swap delays {delays}, rollback after {rolled_back}, requests {len(completed)}, "
        f"max gap {max(gaps):.3f}s"
    )
    assert all(d is not None and d < 2.0 for d in delays), delays
    assert rolled_back is not None, "the harmful version was not rolled back"
    assert store.current("general") == good
    assert failures == []
    assert len(completed) > 10
    assert max(gaps) < 2.0
    metrics = httpx.get(f"{base_url}/metrics").text
    counters = [line for line in metrics.splitlines() if line.startswith("osd_adapter_")]
    rollbacks = [line for line in counters if line.startswith("osd_adapter_rollbacks_total")]
    assert rollbacks and float(rollbacks[0].split()[-1]) >= 1.0, counters
