"""Progress of a build on stderr: tqdm bars when tqdm is installed, plain lines otherwise.

Plain lines carry the same facts as the bars (step, loss, tokens/s, ETA) every few seconds, so
logs of a CI job say where a slow build is. Rates and ETAs come from the recent steps
(:class:`RecentStepTime`; tqdm's own ETA is a moving average too), so they correct themselves
within a minute when the machine gets busy or quiet; a whole-run mean kept saying
hours after a busy neighbour had left, or minutes while one stayed.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Progress", "RecentStepTime", "TrainProgress"]


class RecentStepTime:
    """Seconds per step over roughly the last ``window_s`` seconds.

    Steps and seconds are both summed with weights that decay with the time since, by
    ``exp(-age / window_s)``; their ratio is the recent rate. It weighs time, not step counts,
    so it follows the machine about as fast whether a step takes 0.3 s or 13 s, and before a
    window has passed it is simply the mean so far (no bias towards the first step).
    """

    def __init__(self, window_s: float = 20.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._steps = 0.0  # decayed sums
        self._seconds = 0.0

    @property
    def seconds_per_step(self) -> float | None:
        return self._seconds / self._steps if self._steps else None

    def add(self, seconds: float, steps: int = 1) -> None:
        """Records that ``steps`` steps took ``seconds`` in all."""
        if steps < 1:
            return
        decay = math.exp(-max(seconds, 0.0) / self.window_s)
        self._steps = self._steps * decay + steps
        self._seconds = self._seconds * decay + max(seconds, 0.0)

    def eta(self, remaining_steps: int) -> float | None:
        """Seconds until ``remaining_steps`` more steps are done at the recent rate."""
        per_step = self.seconds_per_step
        return None if per_step is None else max(0, remaining_steps) * per_step


class TrainProgress:
    """Reports one training run; call :meth:`update` after every step, then :meth:`close`."""

    def __init__(
        self,
        name: str,
        total_steps: int,
        start_step: int,
        tokens_per_step: int,
        *,
        enabled: bool,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.name = name
        self.total_steps = total_steps
        self.start_step = start_step
        self.tokens_per_step = tokens_per_step
        self.enabled = enabled
        self.interval_s = interval_s
        self.recent = RecentStepTime()
        self._clock = clock
        self._last_step = self._last_print = clock()
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=total_steps, initial=start_step, desc=name, unit="step", file=sys.stderr
                )

    def update(self, step: int, loss: float) -> None:
        """Records that ``step`` (1-based count of finished steps) ended with ``loss``."""
        if not self.enabled:
            return
        now = self._clock()
        self.recent.add(now - self._last_step)
        self._last_step = now
        tokens_per_s = self.tokens_per_step / max(self.recent.seconds_per_step or 0.0, 1e-9)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            return
        if now - self._last_print >= self.interval_s or step == self.total_steps:
            self._last_print = now
            eta = self.recent.eta(self.total_steps - step) or 0.0
            print(
                f"[{self.name}] step {step}/{self.total_steps} loss {loss:.3f} "
                f"{tokens_per_s:,.0f} tok/s ETA {eta:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class Progress:
    """Stage-level messages and per-training progress; silent when ``enabled`` is False."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stderr, flush=True)

    def training(
        self, name: str, total_steps: int, start_step: int, tokens_per_step: int
    ) -> TrainProgress:
        return TrainProgress(name, total_steps, start_step, tokens_per_step, enabled=self.enabled)
