"""Closed-loop clients for the benchmarks: the same client function on N threads at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["run_clients"]


def run_clients(concurrency: int, client: Callable[[], None]) -> float:
    """Runs ``client`` on ``concurrency`` threads at once (each takes requests until none are
    left); returns the wall seconds until the last one returned."""
    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started
