"""One adapter trained on one device or data parallel on two (`trainer.data_parallel`).

Run from the repository root, alone on the machine::

    python -m bench.bench_data_parallel [--records 64] [--steps 30] [--no-demo]

For the demo pair (when built; else the toy pair) it logs records of real speculative
generations, then times `--steps` LoRA steps of 16 records: one process on every usable core,
one process on one thread, and a group of two processes (gloo) on one thread each, as
`osd train` with `trainer.devices: [cpu, cpu]` runs them. It prints steps/s and the group's
ratio to each single process, and checks the group ends with the weights one process gets.

On a 2-core CPU the two processes share the cores one process's two threads would use, so
this measures what splitting costs (shards, weights sent each step, gradient reduce) more than
what it gains; on a GPU host each rank has its own device.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.bench_trainer import Pair, demo_pair, make_records, new_trainer, toy_pair
from osd.buffer.record import Record
from trainer.data_parallel import DataParallel
from trainer.data_parallel_launch import free_address


def _batches(records: Sequence[Record], steps: int) -> list[list[Record]]:
    chunks = [list(records[i : i + 16]) for i in range(0, len(records) - 15, 16)]
    return [chunks[i % len(chunks)] for i in range(steps + 1)]  # the first one warms up


def _timed(trainer: Any, batches: list[list[Record]]) -> float:
    trainer.train_step("general", batches[0], "all")
    started = time.perf_counter()
    for batch in batches[1:]:
        trainer.train_step("general", batch, "all")
    return (len(batches) - 1) / (time.perf_counter() - started)


def _follower(pair: Pair, address: str) -> None:
    torch.set_num_threads(1)
    group = DataParallel(1, 2, address, "gloo")
    group.follow(new_trainer(pair))


def one_process(pair: Pair, batches: list[list[Record]], threads: int) -> tuple[float, Any]:
    torch.set_num_threads(threads)
    trainer = new_trainer(pair)
    return _timed(trainer, batches), trainer


def two_processes(pair: Pair, batches: list[list[Record]]) -> tuple[float, Any]:
    torch.set_num_threads(1)
    address = free_address()
    child = multiprocessing.get_context("fork").Process(target=_follower, args=(pair, address))
    child.start()
    group = DataParallel(0, 2, address, "gloo")
    try:
        trainer = new_trainer(pair)
        trainer.data_parallel = group
        return _timed(trainer, batches), trainer
    finally:
        group.stop()
        child.join(timeout=60)


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m bench.bench_data_parallel"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--records", type=int, default=64, help="records to log")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--no-demo", action="store_true", help="the toy pair, not the demo's")
    args = parser.parse_args(argv)
    pair = None if args.no_demo else demo_pair()
    pair = pair or toy_pair()
    print(f"pair: {pair.name}")
    batches = _batches(make_records(pair, args.records), args.steps)
    cores = torch.get_num_threads()
    rates: dict[str, float] = {}
    rates[f"one process, {cores} threads"], alone = one_process(pair, batches, cores)
    rates["one process, 1 thread"], _ = one_process(pair, batches, 1)
    rates["two processes (gloo), 1 thread each"], grouped = two_processes(pair, batches)
    group_rate = rates["two processes (gloo), 1 thread each"]
    for name, rate in rates.items():
        print(f"  {name:38s} {rate:6.2f} steps/s   group / this {group_rate / rate:.2f}x")
    worst = max(
        float((grouped.weights("general")[k] - v).abs().max())
        for k, v in alone.weights("general").items()
    )
    print(f"  largest weight difference, group vs one process after {args.steps + 1} steps: "
          f"{worst:.1e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
