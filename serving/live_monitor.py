"""The live monitor: each adapter version's acceptance over a window of drafted tokens, so a
version that serves worse than its predecessor is rolled back (serving.watcher does that).

The runtime feeds it after every request (``observe``); the watcher asks it (``is_worse``).
Both receive the same monitor from the replica's wiring (serving.replica).
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque

__all__ = ["LiveMonitor"]


class LiveMonitor:
    """Acceptance per (adapter, version) over the last ``window`` drafted tokens.

    A version is worse than its predecessor when its rate is lower by more than ``margin`` *and*
    by more than ``z`` standard errors of the difference. Acceptance varies a lot from one
    prompt to the next, so without the second test a window of a few requests rolls back good
    versions on noise (seen in the demo: versions the judge found better were rolled back after
    5 requests). The standard error is the ratio estimator's: with per-request rates ``r_i``
    over ``d_i`` drafted tokens, ``var = n / (n - 1) * sum d_i^2 (r_i - r)^2 / (sum d_i)^2``. Keep
    the window at a few dozen requests (``adapters.rollback_window``, drafted tokens): with only
    a few the estimate of the error is itself noisy.
    """

    def __init__(self, window: int, margin: float, z: float = 2.0) -> None:
        self.window, self.margin, self.z = window, margin, z
        self._requests: dict[tuple[str, int], deque[tuple[int, int]]] = defaultdict(deque)
        self._lock = threading.Lock()

    def observe(self, adapter: str, version: int, accepted: int, drafted: int) -> None:
        with self._lock:
            history = self._requests[(adapter, version)]
            history.append((accepted, drafted))
            while sum(d for _, d in history) - history[0][1] >= self.window:
                history.popleft()

    def forget(self, adapter: str, version: int) -> None:
        """Drops what was seen of a version (its window starts again)."""
        with self._lock:
            self._requests.pop((adapter, version), None)

    def _stats(self, adapter: str, version: int) -> tuple[float, float] | None:
        """(rate, variance of the rate) over the window, or None until a full window was seen."""
        with self._lock:
            history = [(a, d) for a, d in self._requests.get((adapter, version), ()) if d]
        drafted = sum(d for _, d in history)
        if drafted < self.window:
            return None
        rate = sum(a for a, _ in history) / drafted
        variance = sum((a - rate * d) ** 2 for a, d in history) / drafted**2
        if len(history) > 1:  # Bessel's correction; one request alone leaves the margin rule
            variance *= len(history) / (len(history) - 1)
        return rate, variance

    def rate(self, adapter: str, version: int) -> float | None:
        """Acceptance over the window, or None until a full window was seen."""
        stats = self._stats(adapter, version)
        return None if stats is None else stats[0]

    def is_worse(self, adapter: str, version: int, predecessor: int) -> bool:
        new, old = self._stats(adapter, version), self._stats(adapter, predecessor)
        if new is None or old is None:
            return False
        gap = old[0] - new[0]
        return gap > self.margin and gap > self.z * (new[1] + old[1]) ** 0.5
