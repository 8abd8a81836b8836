"""Poisoned traffic: forged records whose logged target distributions come from an unrelated
model are written to the log stream next to a replica's real records, as someone holding the
replicas' (write-only) Redis credentials could. Serving acceptance on real requests must not drop.

Two defences, each shown where it works:

- the trainer's judge estimates acceptance on held-out records. While forged records are a
  minority of the stream, and so of the held-out window, the candidate trained on them loses on
  the honest held-out positions and is refused;
- once forged records dominate the held-out window too, the judge is fooled and publishes; the
  replica's live monitor then sees acceptance on real requests drop and rolls the version back.

docs/reliability.md, rows "poisoned records".
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from osd.adapters import open_adapter_store
from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis, connect
from osd.testing import tiny_llama
from tests.trainer.conftest import make_config, push
from trainer.wiring import wire_trainer
from trainer.worker import TrainerWorker

from .conftest import STREAM, Replica, running_replica, toy_config, wait_for

HOLDOUT_FRACTION = 0.25
PROBES = 32  # real requests per acceptance measurement
# Drafted tokens per version the live monitor compares (about 16 requests here; production's
# config has 4096, so there a poisoned version serves proportionally longer before its rollback).
ROLLBACK_WINDOW = 256


def serving_config() -> Any:
    """The toy deployment, with room for 16 generated tokens per request."""
    return toy_config("serve.max_tokens_limit=16")


def probe_requests(num: int, seed: int) -> list[dict[str, Any]]:
    """Completion bodies with varied character prompts and fixed seeds (reproducible)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz ."
    return [
        {
            "prompt": "".join(rng.choice(letters) for _ in range(rng.randint(3, 12))),
            "max_tokens": 16,
            "temperature": 1.0,
            "seed": seed * 1000 + i,
            "draft": "general",
        }
        for i in range(num)
    ]


def serve(replica: Replica, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sends each request; returns the `osd` stats of each answer (all must be 200)."""
    out = []
    for body in bodies:
        response = replica.complete(**body)
        assert response.status_code == 200, response.text
        out.append(response.json()["osd"])
    return out


def acceptance(stats: list[dict[str, Any]]) -> float:
    """Accepted / drafted tokens over a set of requests."""
    return sum(s["accepted"] for s in stats) / sum(s["drafted"] for s in stats)


def take_real_records(url: str) -> list[Record]:
    """Removes the replica's records from the stream and returns them, renamed ``real-<i>``
    (request ids are random; fixed ones make the hold-out, hence the test, reproducible)."""
    client = connect(url)
    try:
        records = [Record.unpack(f[b"r"]) for _, f in client.xrange(STREAM)]
        client.delete(STREAM)
    finally:
        client.close()
    return [dataclasses.replace(r, request_id=f"real-{i}") for i, r in enumerate(records)]


@torch.no_grad()
def forge(records: list[Record], num: int, seed: int) -> list[Record]:
    """`num` forged records: real token sequences, but the logged target top-m at every
    generated position is an unrelated random model's (same vocabulary)."""
    other = tiny_llama(vocab_size=64, hidden_size=64, num_layers=2, seed=99, logit_scale=4.0)
    forged = []
    for i in range(num):
        record = records[i % len(records)]
        input_ids = torch.tensor(record.token_ids[:-1].astype(np.int64))[None]  # (1, T-1)
        probs = other(input_ids=input_ids).logits[0, record.prompt_len - 1 :].softmax(-1)
        top_probs, top_ids = probs.topk(record.top_m, dim=-1)  # (G, m)
        forged.append(
            dataclasses.replace(
                record,
                request_id=f"forged-{seed}-{i}",
                target_top_ids=top_ids.numpy().astype(np.int32),
                target_top_probs=top_probs.numpy().astype(np.float16),
            )
        )
    return forged


def interleave(honest: list[Record], forged: list[Record]) -> list[Record]:
    """Forged records spread evenly among the honest ones, as a steady flood would be."""
    keyed = [(i / len(honest), 0, r) for i, r in enumerate(honest)]
    keyed += [(i / len(forged), 1, r) for i, r in enumerate(forged)]
    return [r for *_, r in sorted(keyed, key=lambda k: k[:2])]


def trainer_for(tmp_path: Path, url: str) -> TrainerWorker:
    """A trainer of the replicas' toy draft, publishing to the replicas' Redis store."""
    config = make_config(
        tmp_path,
        STREAM,
        "adapters.store=redis",
        "model.adapters=[general]",
        group="trainer",
        holdout_fraction=HOLDOUT_FRACTION,
        max_record_wait_s=0.2,
    )
    return wire_trainer(config, url)


def train_until_idle(worker: TrainerWorker) -> list[Any]:
    reports = []
    for _ in range(200):
        report = worker.run_once(block_ms=50)
        if report is not None:
            reports.append(report)
        elif not any(d.fresh for d in worker.data.values()) and worker.ingest(block_ms=50) == 0:
            return reports
    raise AssertionError("the trainer did not run out of records")


def honest_estimates(worker: TrainerWorker, honest: list[Record]) -> tuple[float, float]:
    """(candidate, current) acceptance lower bounds on honest held-out records only."""
    candidate = worker.trainer.estimate("general", "candidate", honest).lower
    current = worker.trainer.estimate("general", "current", honest).lower
    return candidate, current


def test_judge_refuses_candidates_trained_on_a_minority_of_forged_records(
    redis_server: LocalRedis, tmp_path: Path
) -> None:
    url = redis_server.url
    store = open_adapter_store(url)
    with running_replica(serving_config(), redis_url=url, store=store) as replica:
        before = serve(replica, probe_requests(PROBES, seed=1))
        more = serve(replica, probe_requests(PROBES, seed=2))  # more real traffic
        assert replica.writer.flush(10)
        honest = take_real_records(url)
        forged = forge(honest, len(honest) // 2, seed=0)  # 1 forged per 2 real records
        push(url, STREAM, interleave(honest, forged))

        worker = trainer_for(tmp_path, url)
        reports = train_until_idle(worker)
        held_out_honest = [  # the judge's window: never trained on
            e.record
            for e in worker.data["general"].holdout
            if not e.record.request_id.startswith("forged")
        ]
        candidate_honest, current_honest = honest_estimates(worker, held_out_honest)
        worker.close()
        after = serve(replica, probe_requests(PROBES, seed=1))
        version_after = replica.current()

    outcomes = Counter(r.outcome for r in reports)
    window = worker.data["general"].holdout
    num_forged_held_out = sum(e.record.request_id.startswith("forged") for e in window)
    print(
        f"\n[poison minority] {len(honest)} real records, {len(forged)} forged; held out "
        f"{len(window)} ({num_forged_held_out} forged); rounds {dict(outcomes)}: "
        f"{[r.describe() for r in reports]}; the last candidate on the real held-out records "
        f"{candidate_honest:.3f} vs current {current_honest:.3f}; serving acceptance on "
        f"{PROBES} real requests before {acceptance(before):.3f} after {acceptance(after):.3f} "
        f"(v{version_after}); {len(more)} more requests served"
    )
    # The poison was harmful (negative control) and the judge refused every candidate.
    assert candidate_honest < current_honest - 0.01
    assert outcomes["refused"] >= 1 and outcomes["published"] == 0, outcomes
    assert store.current("general") is None and version_after == 0
    assert acceptance(after) >= acceptance(before) - 0.02


def test_a_version_that_fools_the_judge_is_rolled_back_by_the_live_monitor(
    redis_server: LocalRedis, tmp_path: Path
) -> None:
    url = redis_server.url
    store = open_adapter_store(url)
    with running_replica(
        serving_config(), redis_url=url, store=store, rollback_window=ROLLBACK_WINDOW
    ) as replica:
        before = serve(replica, probe_requests(PROBES, seed=1))
        assert replica.writer.flush(10)
        honest = take_real_records(url)
        forged = forge(honest, 6 * len(honest), seed=1)  # the flood: 6 forged per real record
        push(url, STREAM, interleave(honest, forged))

        worker = trainer_for(tmp_path, url)
        reports = train_until_idle(worker)
        worker.close()
        poisoned = store.current("general")
        assert poisoned is not None, [r.describe() for r in reports]
        wait_for(lambda: replica.current() == poisoned, 10)

        during: list[dict[str, Any]] = []
        bodies = probe_requests(200, seed=3)
        while replica.current() == poisoned and bodies:
            during += serve(replica, [bodies.pop(0)])
        events = [e for e in replica.runtime.adapter_events if e["event"] == "rollback"]
        after = serve(replica, probe_requests(PROBES, seed=1))
        version_after = replica.current()
    # The rollback moved the store's pointer too (to the base draft, BASE_VERSION = 0, when
    # the poisoned version was the first): replicas started later and the trainer follow it.
    pointer_after = store.current("general")
    with running_replica(serving_config(), redis_url=url, store=store) as fresh:
        fresh_version = fresh.current()
    restarted = trainer_for(tmp_path, url)
    trainer_version = restarted.publisher.versions["general"]
    restarted.close()

    served_poisoned = [s for s in during if s["adapter_version"] == poisoned]
    outcomes = Counter(r.outcome for r in reports)
    print(
        f"\n[poison flood] {len(honest)} real records, {len(forged)} forged; rounds "
        f"{dict(outcomes)}: {[r.describe() for r in reports]}; v{poisoned} published (judge "
        f"fooled), served {len(served_poisoned)} requests at acceptance "
        f"{acceptance(served_poisoned):.3f} before the rollback {events}; serving acceptance "
        f"on {PROBES} real requests before {acceptance(before):.3f} after "
        f"{acceptance(after):.3f} (v{version_after}); pointer v{pointer_after}, a replica "
        f"started afterwards serves v{fresh_version}, a restarted trainer resumes from "
        f"v{trainer_version}"
    )
    # The judge did not catch it: it published a version that is worse on real requests.
    assert outcomes["published"] >= 1
    assert acceptance(served_poisoned) < acceptance(before) - 0.05
    # The live monitor did: rolled back after a bounded number of requests, and serving
    # acceptance is back where it was.
    assert events and events[0]["version"] == poisoned
    assert len(served_poisoned) <= 64  # about 4 windows; 18-28 measured
    assert version_after != poisoned
    assert pointer_after == version_after == fresh_version == trainer_version
    assert acceptance(after) >= acceptance(before) - 0.02
