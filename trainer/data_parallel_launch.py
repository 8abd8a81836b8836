"""Starting a data-parallel trainer group on one machine (`osd train` with several
`trainer.devices`): the rendezvous address, each rank's threads, and the followers' processes.
The group itself is `trainer.data_parallel`."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.process
import os
import socket
from collections.abc import Sequence

import torch

from osd.config import load_config
from osd.process import die_with_parent_preexec
from trainer.data_parallel import DataParallel, backend_for
from trainer.draft_trainer import build_draft_trainer

__all__ = ["free_address", "start_followers", "threads_per_rank"]

_log = logging.getLogger(__name__)


def free_address() -> str:
    """``127.0.0.1:<a free port>`` for the group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def threads_per_rank(devices: Sequence[str], torch_threads: int) -> int:
    """Each CPU rank's torch threads: as configured, else the usable cores shared out (CUDA
    ranks: as configured, 0 = torch's default)."""
    if torch_threads or not devices or backend_for(devices) != "gloo":
        return torch_threads
    return max(1, len(os.sched_getaffinity(0)) // len(devices))


def start_followers(
    config_path: str | None, overrides: Sequence[str], address: str
) -> list[multiprocessing.process.BaseProcess]:
    """Starts ranks 1.. of the group `trainer.devices` asks for, each in a fresh process that
    loads the config and the draft itself (nothing of this process is inherited)."""
    devices = load_config(config_path, list(overrides)).trainer.devices
    ctx = multiprocessing.get_context("spawn")
    processes: list[multiprocessing.process.BaseProcess] = []
    for rank in range(1, len(devices)):
        args = (config_path, list(overrides), rank, address)
        process = ctx.Process(target=_follower_main, args=args, name=f"trainer-rank{rank}")
        process.start()
        processes.append(process)
    return processes


def _follower_main(config_path: str | None, overrides: list[str], rank: int, address: str) -> None:
    die_with_parent = die_with_parent_preexec()  # no follower outlives a killed leader
    if die_with_parent is not None:
        die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
    config = load_config(config_path, overrides)
    devices = config.trainer.devices
    threads = threads_per_rank(devices, config.trainer.torch_threads)
    if threads:
        torch.set_num_threads(threads)
    group = DataParallel(rank, len(devices), address, backend_for(devices), device=devices[rank])
    trainer = build_draft_trainer(config, list(config.model.adapters), data_parallel=group)
    _log.info("rank %d of %d on %s: following", rank, len(devices), trainer.device)
    steps = group.follow(trainer)
    _log.info("rank %d: stopped after %d steps", rank, steps)
