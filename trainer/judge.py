"""The judge: publish a candidate adapter only if it beats the current version on held-out data.

Both are estimated on the same held-out records (`osd.acceptance.estimate_acceptance`, mean
lower bound of the per-position acceptance probability over every generated position), so the
comparison is paired: the same positions, the same logged target distributions. The lower bound
is used because it is what the logged top-m can guarantee; the upper bound is reported too.

Pure: no models, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from osd.acceptance import AcceptanceEstimate

__all__ = ["Verdict", "judge"]


@dataclass(frozen=True)
class Verdict:
    """The judge's decision on one candidate.

    Attributes:
        candidate: acceptance estimate of the candidate on the held-out records.
        current: estimate of the current version (or the base draft) on the same records.
        margin: how much the candidate's lower bound must exceed the current one's.
        min_positions: held-out positions needed before anything is judged.
    """

    candidate: AcceptanceEstimate
    current: AcceptanceEstimate
    margin: float
    min_positions: int

    @property
    def enough_data(self) -> bool:
        return min(self.candidate.num_positions, self.current.num_positions) >= self.min_positions

    @property
    def publish(self) -> bool:
        """Whether the candidate goes out: enough data and `candidate > current + margin`."""
        return self.enough_data and self.candidate.lower > self.current.lower + self.margin

    @property
    def gain(self) -> float:
        """Candidate minus current, mean lower bounds."""
        return self.candidate.lower - self.current.lower

    def describe(self) -> str:
        """One line for logs: both estimates and the decision."""
        decision = "publish" if self.publish else ("refuse" if self.enough_data else "wait")
        return (
            f"candidate {self.candidate.lower:.4f} vs current {self.current.lower:.4f} "
            f"(gain {self.gain:+.4f}, margin {self.margin}, "
            f"{self.candidate.num_positions} positions) -> {decision}"
        )


def judge(
    candidate: AcceptanceEstimate,
    current: AcceptanceEstimate,
    *,
    margin: float,
    min_positions: int = 1,
) -> Verdict:
    """Decides whether `candidate` should replace `current`.

    Raises:
        ValueError: `margin` not finite or `min_positions` below 1.
    """
    if not math.isfinite(margin):
        raise ValueError(f"margin must be finite, got {margin}")
    if min_positions < 1:
        raise ValueError(f"min_positions must be >= 1, got {min_positions}")
    return Verdict(candidate, current, margin, min_positions)
