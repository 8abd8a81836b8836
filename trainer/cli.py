"""``osd train``: run the online distillation worker as a process.

    osd train --config configs/train.yaml --redis-url redis://:pw@host:6379/0 trainer.device=cuda

Reads the log stream (``log.stream``) as consumer group ``trainer.group``, publishes adapters to
the store ``adapters.store`` names, logs to W&B as ``wandb.mode`` says (offline by default, under
the run directory). SIGTERM or Ctrl-C stop it after the current step; SIGKILL loses nothing that
was acknowledged (see `trainer.worker`). On exit it prints its totals as one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from osd.buffer.redis_server import redact_url
from osd.config import OSDConfig, load_config

__all__ = ["main"]

_log = logging.getLogger("trainer")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osd train", description="Online distillation worker.")
    parser.add_argument("--config", help="YAML config (default: built-in defaults)")
    parser.add_argument(
        "--redis-url", default="", help="log buffer and adapter store (default: log.redis_url)"
    )
    parser.add_argument("--max-rounds", type=int, default=None, help="stop after this many")
    parser.add_argument(
        "--exit-when-idle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="exit once no record arrived and nothing was trained for this long",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="start this many pool workers on this machine (default trainer.workers)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("overrides", nargs="*", help="config overrides like trainer.device=cuda")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the worker until stopped; returns the process exit code."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(args.config, args.overrides)
        url = args.redis_url or config.log.redis_url
        if not url:
            raise ValueError("the trainer needs a Redis URL: --redis-url or log.redis_url")
    except (OSError, ValueError) as exc:
        print(f"osd train: {exc}", file=sys.stderr)
        return 2

    from trainer.tracking import open_tracker
    from trainer.wiring import wire_trainer

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    workers = config.trainer.workers if args.workers is None else args.workers
    if workers < 1:
        print(f"osd train: --workers must be >= 1, got {workers}", file=sys.stderr)
        return 2
    if workers > 1:
        from trainer.pool_launch import run_members

        argv_list = sys.argv[1:] if argv is None else list(argv)
        return run_members(argv_list, workers, stop)
    devices = config.trainer.devices
    if len(devices) > 1:  # one process per device; this one leads (trainer.data_parallel)
        from trainer.data_parallel_launch import threads_per_rank

        threads = threads_per_rank(devices, config.trainer.torch_threads)
        config = dataclasses.replace(
            config, trainer=dataclasses.replace(config.trainer, torch_threads=threads)
        )
    with _device_group(config, args) as group:
        worker: Any
        if config.trainer.pool:  # one worker of a pool sharing the log (trainer.pool)
            from trainer.pool import PoolWorker

            worker = PoolWorker(config, url, tracker=open_tracker(config), data_parallel=group)
            name = f"pool worker {worker.worker_id}, adapters by lease"
        else:
            worker = wire_trainer(config, url, tracker=open_tracker(config), data_parallel=group)
            name = f"training {', '.join(worker.adapters)}"
        _log.info(
            "%s on %s from %s (group %s), device %s",
            name,
            config.model.draft,
            redact_url(url),
            config.trainer.group,
            ", ".join(devices) if group else worker.trainer.device,
        )
        try:
            worker.run(stop, max_rounds=args.max_rounds, exit_when_idle_s=args.exit_when_idle)
        finally:
            worker.close()
    stats = worker.final_stats if config.trainer.pool else worker.stats.as_dict()
    print(json.dumps({"trainer_stats": stats}), flush=True)
    return 0


@contextlib.contextmanager
def _device_group(config: OSDConfig, args: argparse.Namespace) -> Iterator[Any]:
    """The data-parallel group this process leads when `trainer.devices` names several
    (followers started, stopped on the way out); None for one device."""
    devices = config.trainer.devices
    if len(devices) < 2:
        yield None
        return
    from trainer.data_parallel import DataParallel, backend_for
    from trainer.data_parallel_launch import free_address, start_followers

    address = free_address()
    followers = start_followers(args.config, args.overrides, address)
    try:
        group = DataParallel(0, len(devices), address, backend_for(devices), device=devices[0])
        try:
            yield group
        finally:
            group.stop()
    finally:
        for process in followers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


if __name__ == "__main__":
    raise SystemExit(main())
