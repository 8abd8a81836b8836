"""Hot-swap under load: versions published while clients stream; a bad one is rolled back."""

from __future__ import annotations

import threading
from typing import NamedTuple

import httpx
import openai
import torch

from osd.adapters import open_adapter_store
from osd.adapters.lora import adapter_spec, lora_state_dict
from osd.model_sources import attach_lora_adapters, load_model_pair
from tests.reliability.conftest import wait_for


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


class Served(NamedTuple):
    """One streamed request: the adapter version that served it, how it ended, its text."""

    version: int | None
    finish: str | None
    text: str


def stream_forever(base_url, stop, served, failures):
    """Streams requests one after another until `stop`; appends each one's Served to `served`,
    and each failure to `failures`."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    while not stop.is_set():
        try:
            stream = client.completions.create(
                model="osd",
                prompt="the cat sat",
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},  # the last chunk says the version
                extra_body={"draft": "general"},
            )
            version = finish = None
            text = ""
            for chunk in stream:
                text += "".join(c.text for c in chunk.choices)
                finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
                if chunk.usage is not None:
                    version = chunk.model_extra["osd"]["adapter_version"]
            served.append(Served(version, finish, text))
        except Exception as exc:  # noqa: BLE001 - every failure is counted and asserted on
            failures.append(repr(exc))


def served_version(base_url):
    return httpx.get(f"{base_url}/health", timeout=5).json()["adapters"]["general"]


def test_versions_swap_in_under_load_and_a_bad_one_is_rolled_back(ray_serve_app, serving_redis):
    base_url, config = ray_serve_app
    store = open_adapter_store(serving_redis.url)
    spec, identity, harmful = replica_shaped_weights(config)
    stop, failures = threading.Event(), []
    served = [[], []]  # per client, in the order its requests finished
    clients = [
        threading.Thread(target=stream_forever, args=(base_url, stop, mine, failures))
        for mine in served
    ]

    def num_served():
        return sum(len(mine) for mine in served)

    def was_served_by(version):
        return any(s.version == version for mine in served for s in list(mine))

    published = [served_version(base_url)]  # what serves the clients' first requests
    for thread in clients:
        thread.start()
    try:
        # The live monitor compares each version with its predecessor's last window: let this
        # test's own traffic fill the window of the version in place first (the session's app
        # served other tests' prompts before), or a version identical to it may be rolled back
        # for the change of traffic alone.
        wait_for(lambda: num_served() >= 4, timeout_s=120)
        current = store.current("general")
        for _ in range(5):
            current = store.publish(
                "general", identity, spec=spec, expected_current=current
            ).version
            published.append(current)
            wait_for(lambda v=current: served_version(base_url) == v, timeout_s=60)
            wait_for(lambda v=current: was_served_by(v), timeout_s=60)  # traffic on each one
        good = current
        # A full window of live acceptance for the last good version (40 drafted tokens; a
        # request drafts about 24): otherwise it is unproven and no baseline for the next one.
        enough = num_served() + 4
        wait_for(lambda: num_served() >= enough, timeout_s=120)
        bad = store.publish("general", harmful, spec=spec, expected_current=good).version

        def rolled_back():  # it may be swapped in and rolled back between two looks
            events = httpx.get(f"{base_url}/health", timeout=5).json()["adapter_events"]
            seen = {(e["event"], e["version"]) for e in events}
            return ("swap", bad) in seen and ("rollback", bad) in seen

        wait_for(rolled_back, timeout_s=120, interval_s=0.1)
        wait_for(lambda: served_version(base_url) == good, timeout_s=60)
        # Each client's second request from now began after the rollback.
        counts = [len(mine) for mine in served]
        wait_for(lambda: all(len(m) >= c + 2 for m, c in zip(served, counts, strict=True)), 120)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=120)
    print(f"published {published}, bad {bad}, served {[[s.version for s in m] for m in served]}")
    assert store.current("general") == good
    # Nothing dropped: every request finished normally, none failed.
    assert failures == []
    assert all(s.finish in ("length", "stop") for mine in served for s in mine), served
    # Verification keeps every answer the target's greedy one, whatever draft proposed it (the
    # harmful version included): a swap never changes what a client reads.
    assert len({s.text for mine in served for s in mine}) == 1, served
    for mine in served:
        versions = [s.version for s in mine]
        assert set(versions) <= {*published, bad}, versions
        # In order: a client never went back to an older version, but for the rollback.
        kept = [v for v in versions if v != bad]
        assert kept == sorted(kept), versions
        # The bad version served only between its swap and its rollback, never after.
        at = [i for i, v in enumerate(versions) if v == bad]
        assert not at or at == list(range(at[0], at[-1] + 1)), versions
        assert versions[-1] == good, versions
    metrics = httpx.get(f"{base_url}/metrics").text
    counters = [line for line in metrics.splitlines() if line.startswith("osd_adapter_")]
    rollbacks = [line for line in counters if line.startswith("osd_adapter_rollbacks_total")]
    assert rollbacks and float(rollbacks[0].split()[-1]) >= 1.0, counters
