"""The judge publishes a candidate only when its held-out acceptance beats the current one's by
the margin, and never on too little data."""

from __future__ import annotations

import pytest

from osd.distill.acceptance import AcceptanceEstimate
from trainer.judge import balanced, judge, judge_domains


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


def test_judge_per_domain_refuses_a_candidate_that_forgets_one_domain():
    def est(lower: float, n: int = 200) -> AcceptanceEstimate:
        return AcceptanceEstimate(lower=lower, upper=1.0, num_positions=n)

    current = {"prose": est(0.50), "code": est(0.10)}
    learns_code = {"prose": est(0.50), "code": est(0.40)}
    forgets_prose = {"prose": est(0.45), "code": est(0.60)}  # better on the mean, worse on prose
    verdict = judge_domains(learns_code, current, margin=0.01, max_regression=0.01)
    assert verdict.publish and verdict.gain == pytest.approx(0.15)  # mean of the domains
    refused = judge_domains(forgets_prose, current, margin=0.01, max_regression=0.01)
    assert refused.gain > 0.2 and not refused.publish
    assert refused.regressions == {"prose": pytest.approx(-0.05)}
    assert "worse on prose -0.0500" in refused.describe()
    # a domain with too few positions is neither weighed nor guarded
    tiny = {"prose": est(0.50), "code": est(0.40), "json": est(0.0, n=5)}
    tiny_current = {**current, "json": est(0.9, n=5)}
    noisy = judge_domains(
        tiny, tiny_current, margin=0.01, max_regression=0.01, domain_min_positions=100
    )
    assert noisy.publish and noisy.gain == pytest.approx(0.15)
    with pytest.raises(ValueError, match="domains differ"):
        judge_domains(learns_code, {"prose": est(0.5)}, margin=0.0, max_regression=0.01)


def test_balanced_estimate_weighs_each_domain_equally():
    big = AcceptanceEstimate(lower=0.8, upper=0.9, num_positions=1000)
    small = AcceptanceEstimate(lower=0.2, upper=0.3, num_positions=100)
    mean = balanced({"a": big, "b": small}, min_positions=1)
    assert mean.lower == pytest.approx(0.5) and mean.upper == pytest.approx(0.6)
    assert mean.num_positions == 1100
    assert balanced({}, min_positions=1).num_positions == 0
