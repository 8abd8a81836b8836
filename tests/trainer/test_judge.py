"""The judge publishes a candidate only when its held-out acceptance beats the current one's by
the margin, and never on too little data."""

from __future__ import annotations

import pytest

from osd.acceptance import AcceptanceEstimate
from trainer.judge import judge


def test_judge_publishes_only_a_candidate_better_by_the_margin():
    def est(lower: float, n: int = 100) -> AcceptanceEstimate:
        return AcceptanceEstimate(lower=lower, upper=1.0, num_positions=n)

    assert judge(est(0.62), est(0.60), margin=0.01).publish
    assert not judge(est(0.605), est(0.60), margin=0.01).publish
    assert not judge(est(0.60), est(0.60), margin=0.0).publish  # equal is not better
    waiting = judge(est(0.9, n=3), est(0.1, n=3), margin=0.0, min_positions=10)
    assert not waiting.publish and not waiting.enough_data
    assert "wait" in waiting.describe()
    with pytest.raises(ValueError, match="nan"):
        judge(est(0.5), est(0.5), margin=float("nan"))
