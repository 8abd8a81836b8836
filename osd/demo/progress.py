"""Progress of a build on stderr: tqdm bars when tqdm is installed, plain lines otherwise.

Plain lines carry the same facts as the bars (step, loss, tokens/s, ETA) every few seconds, so
logs of a CI job say where a slow build is.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress", "TrainProgress"]


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
    ) -> None:
        self.name = name
        self.total_steps = total_steps
        self.start_step = start_step
        self.tokens_per_step = tokens_per_step
        self.enabled = enabled
        self.interval_s = interval_s
        self._started = time.perf_counter()
        self._last_print = self._started
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
        elapsed = time.perf_counter() - self._started
        done = step - self.start_step
        tokens_per_s = done * self.tokens_per_step / max(elapsed, 1e-9)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            return
        now = time.perf_counter()
        if now - self._last_print >= self.interval_s or step == self.total_steps:
            self._last_print = now
            eta = (self.total_steps - step) * elapsed / max(done, 1)
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
