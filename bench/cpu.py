"""The benchmarks' torch threads: ``--threads`` (0: chosen like every osd process, osd.threads)."""

from __future__ import annotations

import argparse

from osd.threads import apply_threads

__all__ = ["add_threads_argument", "apply_bench_threads"]


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (default 0: every core this process may use; OSD_TORCH_THREADS)",
    )


def apply_bench_threads(requested: int) -> int:
    """Sets the calling thread's torch threads, prints what was chosen and why; returns it."""
    choice = apply_threads("bench", requested)
    print(choice.describe(), flush=True)
    return choice.num_threads
