"""A pool of trainer workers (`trainer.pool`) at a fixed record rate: lag, record-to-version
latency and per-worker throughput with 1, 2 and 3 workers, and the takeover time after a kill.

Run from the repository root, alone on the machine::

    python -m bench.bench_pool [--workers 1,2,3] [--rate 20] [--duration 30] [--lease-s 10]
                               [--records 96] [--no-demo]

Records of real speculative generations (the demo pair when built, else the toy pair) are
labelled code, sql and none in turn and logged into a private redis-server at `--rate` per
second for `--duration` seconds, while W `osd train` processes (one torch thread each, adapters
general, code and sql) share them. Each second it samples the **consumer lag**: log entries not
yet dispatched plus forwarded records no owner has read yet. After the feed it waits for the
pool to drain, kills the worker that owns the general adapter (SIGKILL) and times how long until
another worker reports owning it, then stops the rest and reads their totals: records trained,
their tokens/s while training, and the record-to-version latency (arrival in the log to the
publication of the first version trained on it).

On a 2-core machine the workers share two cores: more workers do not add compute here, they
split it (per-worker throughput says so). On a GPU host each worker has its own device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.bench_trainer import demo_pair, make_records, toy_pair
from osd.buffer.loop_status import read_pool_status
from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis, connect
from trainer.pool import AUDIT_ENV, adapter_stream

ADAPTERS = ("general", "code", "sql")
REPO = Path(__file__).resolve().parents[1]


def labelled(records: Sequence[Record], count: int, round_: int) -> list[Record]:
    domains = ("code", "sql", "")
    return [
        dataclasses.replace(
            records[i % len(records)], domain=domains[i % 3], request_id=f"b{round_}-{i}"
        )
        for i in range(count)
    ]


def consumer_lag(client: Any, stream: str, group: str) -> int:
    lag = 0
    for key in (stream, *(adapter_stream(stream, a) for a in ADAPTERS)):
        if not client.exists(key):
            continue
        for info in client.xinfo_groups(key):
            if info["name"] in (group, group.encode()):
                lag += int(info.get("lag") or 0)
    return lag


def run_pool(
    url: str,
    workers: int,
    records: Sequence[Record],
    args: argparse.Namespace,
    models: tuple[str, str],
) -> dict[str, Any]:
    stream, group = f"bench:{workers}:{time.time_ns()}", "g"
    run_dir = Path(tempfile.mkdtemp(prefix="osd-bench-pool-"))
    overrides = [
        f"model.target={models[0]}", f"model.draft={models[1]}", f"log.stream={stream}",
        "model.adapters=[general,code,sql]", "routing.enabled=false", "wandb.mode=disabled",
        "adapters.store=redis", f"run_dir={run_dir}", "trainer.device=cpu",
        f"trainer.group={group}", "trainer.pool=true", f"trainer.lease_s={args.lease_s}",
        "trainer.torch_threads=1", "trainer.max_record_wait_s=2",
    ]  # fmt: skip
    audit = run_dir / "audit"  # what each worker trained, kept across its SIGKILL
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), AUDIT_ENV: str(audit)}
    command = [sys.executable, "-m", "launcher.cli", "train", "--redis-url", url, *overrides]
    processes = {
        f"w{i}": subprocess.Popen(
            [*command, f"trainer.consumer=w{i}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(run_dir / f"w{i}.log", "w"),  # noqa: SIM115 - the child's
            text=True,
        )
        for i in range(workers)
    }
    client = connect(url)
    deadline = time.monotonic() + 120
    while len(read_pool_status(client, stream, group, 30)) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError("the pool did not start")
        time.sleep(0.2)
    feed = labelled(records, int(args.rate * args.duration), workers)
    lags: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            lags.append(consumer_lag(client, stream, group))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    for i, record in enumerate(feed):  # at `rate` per second
        time.sleep(max(0.0, started + i / args.rate - time.monotonic()))
        client.xadd(stream, {"r": record.pack()})
    drained_at = time.monotonic() + 60
    while consumer_lag(client, stream, group) and time.monotonic() < drained_at:
        time.sleep(0.2)
    stop.set()
    sampler.join()
    final_lag = consumer_lag(client, stream, group)

    takeover_s = None
    if workers > 1:
        owner = next(
            s["worker"] for s in read_pool_status(client, stream, group, 30)
            if "general" in s["adapters"]
        )  # fmt: skip
        processes[owner].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < 10 * args.lease_s:
            now_owner = [
                s["worker"] for s in read_pool_status(client, stream, group, 30)
                if "general" in s["adapters"] and s["worker"] != owner
            ]  # fmt: skip
            if now_owner:
                takeover_s = time.monotonic() - killed_at
                break
            time.sleep(0.05)
    stats = []
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes.values():
        out, _ = process.communicate(timeout=120)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if lines:
            stats.append(json.loads(lines[-1])["trainer_stats"])
    client.close()
    return {
        "lags": lags,
        "final_lag": final_lag,
        "stats": stats,
        "takeover_s": takeover_s,
        "fed": len(feed),
        "run_dir": str(run_dir),
        "trained": {
            path.stem: len(path.read_text().splitlines()) for path in sorted(audit.glob("*.log"))
        },
    }


def describe(workers: int, result: dict[str, Any], args: argparse.Namespace) -> str:
    stats, lags = result["stats"], result["lags"] or [0]
    trained = " + ".join(str(n) for n in result["trained"].values())
    rates = [s["num_tokens"] / s["train_s"] for s in stats if s.get("train_s")]
    latencies = [s["record_to_version_s"]["p50"] for s in stats if "record_to_version_s" in s]
    takeover = result["takeover_s"]
    return (
        f"  {workers} worker(s): {result['fed']} records at {args.rate}/s; consumer lag mean "
        f"{statistics.fmean(lags):.1f}, max {max(lags)}, after the feed {result['final_lag']}; "
        f"trained (adapter, record) pairs, by worker: {trained}; survivors while training "
        f"{', '.join(f'{r:,.0f}' for r in rates)} tokens/s; record-to-version p50 "
        f"{', '.join(f'{x:.1f}' for x in latencies) or '-'} s"
        + (f"; takeover after SIGKILL {takeover:.1f} s" if takeover is not None else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_pool", description=__doc__)
    parser.add_argument("--workers", default="1,2,3", help="pool sizes to run")
    parser.add_argument("--rate", type=float, default=20.0, help="records logged per second")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of feed per size")
    parser.add_argument("--lease-s", type=float, default=10.0, help="trainer.lease_s")
    parser.add_argument("--records", type=int, default=96, help="distinct records to cycle")
    parser.add_argument("--no-demo", action="store_true", help="the toy pair")
    args = parser.parse_args(argv)
    pair = None if args.no_demo else demo_pair()
    models = ("toy:target", "toy:draft")
    if pair is None:
        pair = toy_pair()
    else:
        from osd.model_sources import find_demo_models

        paths = find_demo_models()
        assert paths is not None
        models = (str(paths.target), str(paths.draft))
    print(f"pair: {pair.name}; lease {args.lease_s} s; cores {len(os.sched_getaffinity(0))}")
    records = make_records(pair, args.records)
    with LocalRedis() as server:
        for workers in (int(w) for w in args.workers.split(",")):
            print(describe(workers, run_pool(server.url, workers, records, args, models), args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
