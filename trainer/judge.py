"""The judge: publish a candidate adapter only if it beats the current version on held-out data.

Both are estimated on the same held-out records (`osd.distill.acceptance.estimate_acceptance`, mean
lower bound of the per-position acceptance probability over every generated position), so the
comparison is paired: the same positions, the same logged target distributions. The lower bound
is used because it is what the logged top-m can guarantee; the upper bound is reported too.

With held-out records of several domains (the general adapter's), each domain is estimated on its
own: the candidate must beat the current version by the margin on the mean over the domains (each
weighs the same, however much traffic it has now), and must not be worse than the current one by
more than `max_regression` on any domain with enough positions. So a general adapter learning
code in a code flood is refused as soon as it starts to forget prose.

Pure: no models, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from osd.distill.acceptance import AcceptanceEstimate

__all__ = ["Verdict", "balanced", "judge", "judge_domains"]


@dataclass(frozen=True)
class Verdict:
    """The judge's decision on one candidate.

    Attributes:
        candidate: acceptance estimate of the candidate on the held-out records.
        current: estimate of the current version (or the base draft) on the same records.
        margin: how much the candidate's lower bound must exceed the current one's.
        min_positions: held-out positions needed before anything is judged.
        domains: domain -> (candidate, current) estimates on that domain's held-out records,
            when judged per domain.
        max_regression: how much worse than the current version the candidate may be on one
            domain with at least `domain_min_positions` positions.
        domain_min_positions: positions a domain needs to be weighed and guarded.
    """

    candidate: AcceptanceEstimate
    current: AcceptanceEstimate
    margin: float
    min_positions: int
    domains: Mapping[str, tuple[AcceptanceEstimate, AcceptanceEstimate]] = field(
        default_factory=dict
    )
    max_regression: float = 1.0
    domain_min_positions: int = 1

    @property
    def enough_data(self) -> bool:
        return min(self.candidate.num_positions, self.current.num_positions) >= self.min_positions

    @property
    def regressions(self) -> dict[str, float]:
        """Domains (with enough positions) where the candidate loses more than allowed."""
        return {
            domain: cand.lower - cur.lower
            for domain, (cand, cur) in self.domains.items()
            if min(cand.num_positions, cur.num_positions) >= self.domain_min_positions
            and cand.lower < cur.lower - self.max_regression
        }

    @property
    def publish(self) -> bool:
        """Whether the candidate goes out: enough data, `candidate > current + margin`, and no
        domain worse by more than `max_regression`."""
        return (
            self.enough_data
            and self.candidate.lower > self.current.lower + self.margin
            and not self.regressions
        )

    @property
    def gain(self) -> float:
        """Candidate minus current, mean lower bounds."""
        return self.candidate.lower - self.current.lower

    def describe(self) -> str:
        """One line for logs: both estimates and the decision."""
        decision = "publish" if self.publish else ("refuse" if self.enough_data else "wait")
        worse = ", ".join(f"{d or '-'} {g:+.4f}" for d, g in self.regressions.items())
        per_domain = f", {len(self.domains)} domains" if len(self.domains) > 1 else ""
        return (
            f"candidate {self.candidate.lower:.4f} vs current {self.current.lower:.4f} "
            f"(gain {self.gain:+.4f}, margin {self.margin}, "
            f"{self.candidate.num_positions} positions{per_domain}"
            f"{f'; worse on {worse}' if worse else ''}) -> {decision}"
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


def balanced(estimates: Mapping[str, AcceptanceEstimate], min_positions: int) -> AcceptanceEstimate:
    """The unweighted mean over the domains with at least `min_positions` positions (all of them
    if none has), counting every position."""
    parts = [e for e in estimates.values() if e.num_positions >= min_positions]
    parts = parts or [e for e in estimates.values() if e.num_positions > 0]
    if not parts:
        return AcceptanceEstimate(lower=0.0, upper=1.0, num_positions=0)
    lower = math.fsum(e.lower for e in parts) / len(parts)
    upper = math.fsum(e.upper for e in parts) / len(parts)
    total = sum(e.num_positions for e in estimates.values())
    return AcceptanceEstimate(lower=lower, upper=max(lower, upper), num_positions=total)


def judge_domains(
    candidate: Mapping[str, AcceptanceEstimate],
    current: Mapping[str, AcceptanceEstimate],
    *,
    margin: float,
    max_regression: float,
    min_positions: int = 1,
    domain_min_positions: int = 1,
) -> Verdict:
    """Judges per domain: the domains' mean must gain `margin`, no domain may lose more than
    `max_regression` (see the module's docstring). Nothing is judged with fewer than
    `min_positions` positions in all; a domain with fewer than `domain_min_positions` is neither
    weighed nor guarded (unless no domain has that many: then all are weighed).

    Raises:
        ValueError: the two sides name different domains, or a bad margin or threshold.
    """
    if set(candidate) != set(current):
        raise ValueError(f"domains differ: {sorted(candidate)} vs {sorted(current)}")
    if not 0.0 <= max_regression < 1.0:
        raise ValueError(f"max_regression must be in [0, 1), got {max_regression}")
    if domain_min_positions < 1:
        raise ValueError(f"domain_min_positions must be >= 1, got {domain_min_positions}")
    verdict = judge(
        balanced(candidate, domain_min_positions),
        balanced(current, domain_min_positions),
        margin=margin,
        min_positions=min_positions,
    )
    domains = {d: (candidate[d], current[d]) for d in sorted(candidate)}
    return Verdict(
        verdict.candidate,
        verdict.current,
        margin,
        min_positions,
        domains,
        max_regression,
        domain_min_positions,
    )
