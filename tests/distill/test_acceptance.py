"""Acceptance estimates from logged top-m: bounds bracket the true value, exact when m == V."""

from __future__ import annotations

import pytest
import torch

from osd.distill.acceptance import (
    AcceptanceEstimate,
    acceptance_bounds,
    estimate_acceptance,
    expected_tokens_per_step,
)


def _case(seed: int, batch: int = 3, num_positions: int = 5, vocab_size: int = 8):
    gen = torch.Generator().manual_seed(seed)
    draft_logits = torch.randn(batch, num_positions, vocab_size, generator=gen) * 2
    target_probs = torch.softmax(
        torch.randn(batch, num_positions, vocab_size, generator=gen) * 2, dim=-1
    )
    true_beta = torch.minimum(target_probs, torch.softmax(draft_logits, dim=-1)).sum(-1)
    return draft_logits, target_probs, true_beta


def test_hand_computed_bounds_with_a_tail():
    # p logs ids (3, 0) with (0.5, 0.3), tail 0.2; q = (0.1, 0.2, 0.3, 0.4) puts 0.5 on the tail.
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().view(1, 1, 4)
    lower, upper = acceptance_bounds(logits, torch.tensor([[[3, 0]]]), torch.tensor([[[0.5, 0.3]]]))
    torch.testing.assert_close(lower, torch.tensor([[0.4 + 0.1]]))
    torch.testing.assert_close(upper, torch.tensor([[0.4 + 0.1 + 0.2]]))


@pytest.mark.parametrize("num_top", [1, 2, 4, 7])
def test_bounds_bracket_the_full_vocabulary_acceptance(num_top):
    draft_logits, target_probs, true_beta = _case(seed=num_top)
    probs, ids = target_probs.topk(num_top, dim=-1)
    lower, upper = acceptance_bounds(draft_logits, ids, probs)
    assert (lower <= true_beta + 1e-6).all()
    assert (true_beta <= upper + 1e-6).all()
    assert (upper <= lower + (1 - probs.sum(-1)) + 1e-6).all()


def test_bounds_are_exact_when_all_ids_are_logged():
    draft_logits, target_probs, true_beta = _case(seed=11)
    probs, ids = target_probs.topk(8, dim=-1)
    lower, upper = acceptance_bounds(draft_logits, ids, probs)
    torch.testing.assert_close(lower, true_beta, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(upper, true_beta, rtol=1e-5, atol=1e-6)


def test_estimate_averages_masked_positions_only():
    draft_logits, target_probs, true_beta = _case(seed=12)
    probs, ids = target_probs.topk(8, dim=-1)
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(0)) < 0.5
    estimate = estimate_acceptance(draft_logits, ids, probs, mask)
    assert estimate.num_positions == int(mask.sum())
    torch.testing.assert_close(estimate.lower, true_beta[mask].mean().item(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(estimate.upper, estimate.lower, rtol=1e-5, atol=1e-6)


def test_estimate_with_no_positions_is_the_trivial_interval():
    draft_logits, target_probs, _ = _case(seed=13)
    probs, ids = target_probs.topk(3, dim=-1)
    estimate = estimate_acceptance(draft_logits, ids, probs, torch.zeros(3, 5, dtype=torch.bool))
    assert estimate == AcceptanceEstimate(lower=0.0, upper=1.0, num_positions=0)


def test_combined_estimate_equals_estimate_over_all_positions():
    draft_logits, target_probs, _ = _case(seed=14)
    probs, ids = target_probs.topk(3, dim=-1)
    mask = torch.ones(3, 5, dtype=torch.bool)
    whole = estimate_acceptance(draft_logits, ids, probs, mask)
    parts = [
        estimate_acceptance(draft_logits[i : i + 1], ids[i : i + 1], probs[i : i + 1], mask[:1])
        for i in range(3)
    ]
    combined = AcceptanceEstimate.combine([*parts, AcceptanceEstimate(0.0, 1.0, 0)])
    assert combined.num_positions == whole.num_positions
    torch.testing.assert_close(combined.lower, whole.lower, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(combined.upper, whole.upper, rtol=1e-9, atol=1e-9)


def test_better_draft_gets_higher_estimate():
    _, target_probs, _ = _case(seed=15)
    probs, ids = target_probs.topk(3, dim=-1)
    mask = torch.ones(3, 5, dtype=torch.bool)
    good = estimate_acceptance(target_probs.log(), ids, probs, mask)
    uniform = estimate_acceptance(torch.zeros(3, 5, 8), ids, probs, mask)
    assert good.lower > uniform.upper


@pytest.mark.parametrize(
    ("alpha", "num_spec_tokens", "expected"),
    [
        (0.0, 4, 1.0),
        (0.5, 1, 1.5),
        (0.5, 2, 1.75),
        (0.8, 4, (1 - 0.8**5) / (1 - 0.8)),
        (1.0, 4, 5.0),
        (1.0, 0, 1.0),
        (1 - 1e-12, 3, 4.0),
    ],
)
def test_expected_tokens_per_step_table(alpha, num_spec_tokens, expected):
    assert expected_tokens_per_step(alpha, num_spec_tokens) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("alpha", "num_spec_tokens"), [(-0.1, 3), (1.5, 3), (float("nan"), 3), (0.5, -1), (0.5, 2.0)]
)
def test_expected_tokens_per_step_rejects_bad_arguments(alpha, num_spec_tokens):
    with pytest.raises(ValueError, match="must be"):
        expected_tokens_per_step(alpha, num_spec_tokens)
