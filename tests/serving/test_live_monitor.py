"""The live monitor rolls back a version that is clearly worse, not one that drew harder prompts."""

from __future__ import annotations

import random

from serving.live_monitor import LiveMonitor


def feed(monitor: LiveMonitor, version: int, rates: list[float], drafted: int = 48) -> None:
    for rate in rates:
        monitor.observe("code", version, round(rate * drafted), drafted)


def noisy_rates(mean: float, n: int, seed: int) -> list[float]:
    """Per-request acceptance as the demo shows it: prompts differ far more than versions."""
    rng = random.Random(seed)
    return [min(1.0, max(0.0, rng.gauss(mean, 0.25))) for _ in range(n)]


def test_window_must_fill_before_anything_is_judged():
    monitor = LiveMonitor(window=480, margin=0.05)
    feed(monitor, 1, [0.9] * 10)
    feed(monitor, 2, [0.0] * 9)  # 432 drafted tokens: not a full window yet
    assert monitor.rate("code", 2) is None and not monitor.is_worse("code", 2, 1)
    feed(monitor, 2, [0.0])
    assert monitor.rate("code", 2) == 0.0 and monitor.is_worse("code", 2, 1)


def rollbacks(old_mean: float, new_mean: float, runs: int = 50) -> int:
    """In how many of `runs` seeded trials (20 requests per version) the new one is rolled back."""
    count = 0
    for seed in range(runs):
        monitor = LiveMonitor(window=960, margin=0.05)
        feed(monitor, 1, noisy_rates(old_mean, 20, seed))
        feed(monitor, 2, noisy_rates(new_mean, 20, 1000 + seed))
        count += monitor.is_worse("code", 2, 1)
    return count


def test_a_version_as_good_as_its_predecessor_is_kept_despite_per_prompt_noise():
    assert rollbacks(0.5, 0.5) <= 2  # a margin-only rule rolls back about one in four of these


def test_a_clearly_worse_version_is_rolled_back():
    assert rollbacks(0.5, 0.2) >= 48
