"""The build's ETA follows the recent steps, so it corrects itself when the machine gets busy or
quiet (a whole-run mean kept the old rate for most of the run)."""

from __future__ import annotations

import sys

import pytest

from osd.demo.progress import RecentStepTime, TrainProgress

QUIET, BUSY = 0.36, 1.28  # seconds per step of the demo target, alone and beside a busy process


def fed(durations: list[float]) -> RecentStepTime:
    recent = RecentStepTime()
    for seconds in durations:
        recent.add(seconds)
    return recent


@pytest.mark.parametrize(
    ("durations", "now"),
    [
        ([QUIET] * 200 + [BUSY] * 60, BUSY),  # a neighbour started 77 s ago
        ([BUSY] * 60 + [QUIET] * 200, QUIET),  # and left 72 s ago
        ([13.0] * 3 + [QUIET] * 200, QUIET),  # slow first steps are forgotten
    ],
)
def test_eta_follows_the_recent_rate_not_the_whole_run_mean(durations, now):
    recent = fed(durations)
    mean = sum(durations) / len(durations)
    assert recent.seconds_per_step == pytest.approx(now, rel=0.1)
    assert abs(mean - now) / now > 0.3  # negative control: the old estimate was far off
    assert recent.eta(100) == pytest.approx(100 * recent.seconds_per_step)


def moved(start: float, now: float, estimate: float) -> float:
    """How far a per-step estimate went from ``start`` to ``now``, in rates (0 to 1)."""
    return (1 / start - 1 / estimate) / (1 / start - 1 / now)


@pytest.mark.parametrize("busy", [1.2, 12.0])
def test_the_window_is_time_not_steps(busy):
    # After 60 s (three windows) of slower steps the estimate is most of the way there, whether
    # those were 50 steps or 5; counted in steps, 5 would hardly move it.
    durations = [QUIET] * 200 + [busy] * round(60 / busy)
    assert moved(QUIET, busy, fed(durations).seconds_per_step) > 0.9
    assert moved(QUIET, busy, sum(durations) / len(durations)) < 0.6  # the whole-run mean


def test_no_estimate_before_the_first_step_then_the_mean_until_a_window_passed():
    recent = RecentStepTime()
    assert recent.eta(10) is None
    recent.add(2.0, steps=4)
    assert recent.seconds_per_step == 0.5 and recent.eta(0) == 0.0
    # Within the first window: about the mean so far, not the first step's rate.
    assert fed([2.0, 0.5, 0.5, 0.5]).seconds_per_step == pytest.approx(0.875, rel=0.05)
    with pytest.raises(ValueError, match="window_s"):
        RecentStepTime(window_s=0)


def test_plain_progress_line_reports_the_recent_rate(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # plain lines, as without tqdm
    clock = iter([0.0] + [QUIET * i for i in range(1, 201)] + [72 + BUSY * i for i in range(61)])
    progress = TrainProgress(
        "target", 800, 0, 2048, enabled=True, interval_s=1e9, clock=lambda: next(clock)
    )
    for step in range(1, 261):
        progress.update(step, 1.0)
    progress.update(800, 1.0)  # the last step always prints
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("[target] step 800/800 loss 1.000")
    tokens_per_s = float(line.split(" tok/s")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert tokens_per_s == pytest.approx(2048 / BUSY, rel=0.1)
