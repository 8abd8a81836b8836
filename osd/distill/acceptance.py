"""Acceptance estimates from logged target distributions, without serving the draft.

docs/algorithms.md, "Acceptance estimates": for one position with target `p` and draft `q`,
`beta = sum_x min(p(x), q(x))` is the exact probability that token verification accepts a token
drafted from `q` (at temperature 1, which is what the replicas log). Averaged over logged
positions it estimates a draft's acceptance rate on real traffic, which is how a candidate
adapter is judged before it is published.

Only the target's top-m is logged, so `beta` is bracketed:

- lower bound: `sum over the top-m of min(p, q)`;
- upper bound: the lower bound plus `min(P_tail, Q_tail)`, where `P_tail = 1 - sum(top-m p)` and
  `Q_tail` is the draft's mass outside the top-m ids. Since `sum over the tail of min(p, q)` is
  at most both tail masses, this is never looser than adding `P_tail` alone.

When m == V both bounds equal `beta`. The upper bound also equals `1 - tvd_loss` per position
(the TVD over the same m + 1 buckets), so training on TVD pushes exactly this bound up.

Pure: torch only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from osd.distill.losses import top_m_buckets

__all__ = [
    "AcceptanceEstimate",
    "acceptance_bounds",
    "estimate_acceptance",
    "expected_tokens_per_step",
]


@dataclass(frozen=True)
class AcceptanceEstimate:
    """Mean acceptance bounds over a set of logged positions.

    Attributes:
        lower: mean lower bound of `beta`, in [0, 1].
        upper: mean upper bound of `beta`, in [lower, 1].
        num_positions: how many positions were averaged; with none, the bounds are the trivial
            [0, 1].
    """

    lower: float
    upper: float
    num_positions: int

    def __post_init__(self) -> None:
        if self.num_positions < 0:
            raise ValueError(f"num_positions must be >= 0, got {self.num_positions}")
        if not 0.0 <= self.lower <= self.upper <= 1.0 + 1e-6:
            raise ValueError(
                f"need 0 <= lower <= upper <= 1, got lower={self.lower} upper={self.upper}"
            )

    @classmethod
    def combine(cls, estimates: Iterable[AcceptanceEstimate]) -> AcceptanceEstimate:
        """The estimate over the union of the positions of `estimates` (position-weighted)."""
        parts = [e for e in estimates if e.num_positions > 0]
        total = sum(e.num_positions for e in parts)
        if total == 0:
            return cls(lower=0.0, upper=1.0, num_positions=0)
        lower = sum(e.lower * e.num_positions for e in parts) / total
        upper = sum(e.upper * e.num_positions for e in parts) / total
        return cls(lower=lower, upper=max(lower, upper), num_positions=total)


@torch.no_grad()
def acceptance_bounds(
    draft_logits: Tensor, target_top_ids: Tensor, target_top_probs: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-position bounds on `beta = sum_x min(p(x), q(x))`.

    Args:
        draft_logits: (B, T, V) draft logits (temperature 1).
        target_top_ids: (B, T, m) logged target token ids, distinct within a position.
        target_top_probs: (B, T, m) their target probabilities at temperature 1.

    Returns:
        `(lower, upper)`, each (B, T) fp32 with `0 <= lower <= upper <= 1`.
    """
    target_probs, draft_log_probs, _ = top_m_buckets(draft_logits, target_top_ids, target_top_probs)
    overlap = torch.minimum(target_probs, draft_log_probs.exp())  # (B, T, m+1)
    # A position without a tail has target tail mass 0, so its tail overlap is 0 too.
    lower = overlap[..., :-1].sum(dim=-1).clamp(max=1.0)  # (B, T)
    upper = (lower + overlap[..., -1]).clamp(max=1.0)  # (B, T)
    return lower, upper


def estimate_acceptance(
    draft_logits: Tensor, target_top_ids: Tensor, target_top_probs: Tensor, mask: Tensor
) -> AcceptanceEstimate:
    """Mean acceptance bounds over the positions where `mask` is True.

    Args:
        draft_logits, target_top_ids, target_top_probs: as in `acceptance_bounds`.
        mask: (B, T) bool, the positions to average over.

    Returns:
        The estimate; `AcceptanceEstimate.combine` merges estimates of several batches.
    """
    if mask.shape != draft_logits.shape[:2] or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool (B, T) = {tuple(draft_logits.shape[:2])} tensor, "
            f"got {mask.dtype} shape {tuple(mask.shape)}"
        )
    lower, upper = acceptance_bounds(draft_logits, target_top_ids, target_top_probs)
    num_positions = int(mask.sum())
    if num_positions == 0:
        return AcceptanceEstimate(lower=0.0, upper=1.0, num_positions=0)
    mean_lower = float(lower[mask].double().mean())
    mean_upper = float(upper[mask].double().mean())
    return AcceptanceEstimate(
        lower=mean_lower, upper=max(mean_lower, mean_upper), num_positions=num_positions
    )


def expected_tokens_per_step(alpha: float, num_spec_tokens: int) -> float:
    """Expected tokens emitted per target forward with token verification.

    `(1 - alpha^(k+1)) / (1 - alpha)` for acceptance rate `alpha` and `k = num_spec_tokens`
    drafted tokens (Leviathan et al. 2023); `k + 1` in the limit alpha -> 1. Computed as the
    geometric sum `1 + alpha + ... + alpha^k`, which is the same number without the 0/0 at 1.

    Raises:
        ValueError: alpha outside [0, 1] or num_spec_tokens negative.
    """
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if isinstance(num_spec_tokens, bool) or not isinstance(num_spec_tokens, int):
        raise ValueError(f"num_spec_tokens must be an int, got {num_spec_tokens!r}")
    if num_spec_tokens < 0:
        raise ValueError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
    return math.fsum(alpha**i for i in range(num_spec_tokens + 1))
