"""Content routing: the online loop on the same records with and without domain labels.

Run from the repository root (needs the demo pair: ``osd demo-models build``)::

    python -m bench.bench_routing [--schedule prose:40,code:120,sql:120] [--per-round 8]

1. Logs one record per *training* prompt of each phase of ``--schedule`` (real greedy requests
   with the base draft, as the demo's traffic is; cached under ``--cache``), and records of
   ``--eval-prompts`` *held-out* prompts per domain to measure on.
2. Runs the real ``TrainerWorker`` (the demo config, a private redis-server, a directory adapter
   store) twice on the same stream, pushing ``--per-round`` records before each ``run_once``
   (at most one round), so the trainer keeps the same pace against the traffic in both runs:
   **labelled** (each record names its domain) and **unlabeled** (the same records with no
   domain: topics open adapters, the routing model learns from scores).
3. Per shifted domain: records of that domain pushed when the adapter that serves it published
   its first version (labelled: the domain's own; unlabeled: the one the router sends most of its
   held-out prompts to), and the acceptance estimate (mean lower bound of sum min(p, q)) on its
   held-out records at the end: under its own adapter (labelled) or under the adapter the
   published routing model picks for each record (unlabeled), against the base draft. Prints the
   unlabeled gain as a share of the labelled one, and the routing model's accuracy over time.
There is no pass or fail.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_online_vs_offline import (
    _prompts,
    add_output_args,
    demo_setup,
    log_records,
    online_config,
)
from osd import SpeculativeDecoder
from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis
from osd.buffer.writer import LogWriter
from osd.demo import parse_schedule
from osd.routing import stack_features
from osd.routing.store import RoutingStats
from trainer.wiring import wire_trainer
from trainer.worker import TrainerWorker


def run_loop(
    args: argparse.Namespace,
    draft: Any,
    stream: Sequence[Record],
    domains: Sequence[str],
    evals: dict[str, list[Record]],
    labels: bool,
) -> dict[str, Any]:
    """One online run over `stream`; returns first versions, final estimates, routing points."""
    name = "labelled" if labels else "unlabeled"
    with LocalRedis() as server, tempfile.TemporaryDirectory() as tmp:
        config = online_config(tmp)
        worker = wire_trainer(config, server.url, draft=draft, base_model_id="demo:draft")
        base = {d: _mean(worker, "general", evals[d]) for d in evals}
        writer = LogWriter(server.url, config.log.stream)
        seen: Counter[str] = Counter()
        first: dict[str, dict[str, int]] = {}  # adapter -> domain counts when its v1 came
        started = time.perf_counter()
        for start in range(0, len(stream), args.per_round):
            for record in stream[start : start + args.per_round]:
                seen[record.domain] += 1
                writer.log(record if labels else dataclasses.replace(record, domain=""))
            writer.flush()
            worker.run_once(block_ms=100)
            for adapter, version in worker.publisher.versions.items():
                if version is not None and adapter not in first:
                    first[adapter] = dict(seen)
        writer.close()
        train_s = time.perf_counter() - started
        routing = worker.routing
        model = routing.model
        final, served_by, chosen_share = {}, {}, {}
        for domain, records in evals.items():
            if labels:
                adapter = domain if domain in worker.adapters else "general"
                picks = [adapter] * len(records)
            elif model is not None:
                features = stack_features([r.token_ids[: r.prompt_len] for r in records])
                picks = model.choices(features)
            else:
                picks = ["general"] * len(records)
            final[domain] = _routed(worker, records, picks)
            adapter, count = Counter(picks).most_common(1)[0]
            served_by[domain], chosen_share[domain] = adapter, round(count / len(picks), 2)
        points = RoutingStats(server.url, config.log.stream).all()
        worker.close()
    out = {
        "run": name,
        "train_s": round(train_s, 1),
        "base": base,
        "final": final,
        "served_by": served_by,
        "chosen_share": chosen_share,
        "first_version_after": {
            d: first.get(served_by[d], {}).get(d) if served_by[d] != "general" else None
            for d in domains
        },
        "routing_points": [
            {k: p.get(k) for k in ("outcome", "model_accuracy", "routed", "current", "topics")}
            for p in points
        ],
        "versions": {a: v for a, v in worker.publisher.versions.items() if v is not None},
    }
    print(f"{name}: {json.dumps({k: v for k, v in out.items() if k != 'routing_points'})}")
    return out


def _mean(worker: TrainerWorker, adapter: str, records: Sequence[Record]) -> float:
    return round(float(np.mean(worker.trainer.record_acceptance(adapter, "current", records))), 4)


def _routed(worker: TrainerWorker, records: Sequence[Record], picks: Sequence[str]) -> float:
    scores = []
    for adapter in sorted(set(picks)):
        mine = [r for r, p in zip(records, picks, strict=True) if p == adapter]
        scores += worker.trainer.record_acceptance(adapter, "current", mine)
    return round(float(np.mean(scores)), 4)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_routing")
    parser.add_argument("--schedule", default="prose:40,code:120,sql:120")
    parser.add_argument("--per-round", type=int, default=8, help="records pushed per run_once")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--eval-prompts", type=int, default=24, help="held-out prompts a domain")
    add_output_args(parser)
    args = parser.parse_args(argv)
    paths, cache, target, base_draft, tokenizer = demo_setup(args, logging.WARNING)
    engine = SpeculativeDecoder(target, base_draft, tokenizer)
    phases = parse_schedule(args.schedule)
    domains = list(dict.fromkeys(d for d, _ in phases))
    stream: list[Record] = []
    used: Counter[str] = Counter()
    for domain, count in phases:
        prompts = _prompts(paths, domain, "train")[used[domain] : used[domain] + count]
        tag = f"route{used[domain]}"
        stream += log_records(engine, prompts, domain, args.max_tokens, tag, cache)
        used[domain] += count
    evals = {
        d: log_records(
            engine,
            _prompts(paths, d, "heldout")[: args.eval_prompts],
            d,
            args.max_tokens,
            "eval",
            cache,
        )
        for d in domains
    }
    print(f"logged {len(stream)} records ({args.schedule}) and {args.eval_prompts} per domain")
    shifted = domains[1:]  # the first phase is the traffic the loop starts on
    runs = [
        run_loop(args, copy.deepcopy(base_draft), stream, shifted, evals, labels)
        for labels in (True, False)
    ]
    labelled, unlabeled = runs
    print("\ndomain: base -> labelled / unlabeled (gain), unlabeled gain as a share of labelled's;")
    print("first version in the domain's records since its shift, labelled / unlabeled")
    for d in domains:
        base = labelled["base"][d]
        gains = [r["final"][d] - base for r in runs]
        share = f"{gains[1] / gains[0]:.2f}" if gains[0] > 0.02 else "n/a"
        print(
            f"  {d:6s} {base:.3f} -> {labelled['final'][d]:.3f} ({gains[0]:+.3f}) / "
            f"{unlabeled['final'][d]:.3f} ({gains[1]:+.3f}, via {unlabeled['served_by'][d]} "
            f"{unlabeled['chosen_share'][d]:.0%}): {share}; first versions "
            f"{labelled['first_version_after'].get(d)} / {unlabeled['first_version_after'].get(d)}"
        )
    accuracy = [p["model_accuracy"] for p in unlabeled["routing_points"]]
    accuracy = [a for a in accuracy if a is not None]
    if accuracy:
        quarters = [np.mean(q) for q in np.array_split(np.array(accuracy), 4) if len(q)]
        print("routing model accuracy on held-out records, by quarter of the run: "
              + ", ".join(f"{q:.2f}" for q in quarters))  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
