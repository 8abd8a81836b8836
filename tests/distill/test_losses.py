"""Distillation losses over top-m + tail buckets: hand-computed tables, full-vocabulary
references when m == V, the tail bucket when m < V, masking and gradient hygiene."""

from __future__ import annotations

import math

import pytest
import torch

from osd.distill.acceptance import acceptance_bounds
from osd.distill.losses import (
    MIN_TARGET_PROB,
    distillation_loss,
    jsd_loss,
    top_m_buckets,
    tvd_loss,
)

LOSS_NAMES = ["forward_kl", "reverse_kl", "jsd", "tvd"]


def _as_batch(draft_probs: list[float], top_ids: list[int], top_probs: list[float]):
    """One position: logits whose softmax is `draft_probs`, and the logged top-m."""
    logits = torch.tensor(draft_probs, dtype=torch.float64).log().float().view(1, 1, -1)
    ids = torch.tensor(top_ids).view(1, 1, -1)
    probs = torch.tensor(top_probs).view(1, 1, -1)
    return logits, ids, probs, torch.ones(1, 1, dtype=torch.bool)


def _reference(name: str, logits: torch.Tensor, p: torch.Tensor, beta: float = 0.5):
    """Per-position full-vocabulary divergence, straight from the definitions, in float64."""
    log_q = torch.log_softmax(logits.double(), dim=-1)
    q, p = log_q.exp(), p.double()
    if name == "forward_kl":
        return (torch.xlogy(p, p) - p * log_q).sum(-1)
    if name == "reverse_kl":
        return (q * (log_q - p.log())).sum(-1)
    if name == "jsd":
        log_m = (beta * p + (1 - beta) * q).log()
        kl_pm = (torch.xlogy(p, p) - p * log_m).sum(-1)
        kl_qm = (q * (log_q - log_m)).sum(-1)
        return beta * kl_pm + (1 - beta) * kl_qm
    return 0.5 * (p - q).abs().sum(-1)


def _random_case(batch: int, num_positions: int, vocab_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, num_positions, vocab_size, generator=gen) * 2
    target_probs = torch.softmax(
        torch.randn(batch, num_positions, vocab_size, generator=gen) * 2, dim=-1
    )
    return logits, target_probs


def _top_m(target_probs: torch.Tensor, num_top: int):
    probs, ids = target_probs.topk(num_top, dim=-1)
    return ids, probs


# p = (0.5, 0.3, 0.2) logged in full, q = (0.25, 0.25, 0.5).
_P, _Q = (0.5, 0.3, 0.2), (0.25, 0.25, 0.5)
_M = tuple(0.5 * a + 0.5 * b for a, b in zip(_P, _Q, strict=True))
_HAND_V3 = {
    "forward_kl": sum(a * math.log(a / b) for a, b in zip(_P, _Q, strict=True)),
    "reverse_kl": sum(b * math.log(b / a) for a, b in zip(_P, _Q, strict=True)),
    "jsd": 0.5 * sum(a * math.log(a / m) for a, m in zip(_P, _M, strict=True))
    + 0.5 * sum(b * math.log(b / m) for b, m in zip(_Q, _M, strict=True)),
    "tvd": 0.5 * (0.25 + 0.05 + 0.3),
}


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_full_table_matches_hand_computed_value(name):
    logits, ids, probs, mask = _as_batch(list(_Q), [0, 1, 2], list(_P))
    loss = distillation_loss(name, logits, ids, probs, mask)
    torch.testing.assert_close(loss.item(), _HAND_V3[name], rtol=1e-5, atol=1e-6)


# V = 4, m = 2: p logs ids (3, 0) with (0.5, 0.3), tail 0.2; q = (0.1, 0.2, 0.3, 0.4), so the
# draft puts (0.4, 0.1) on the logged ids and 0.5 on the tail.
_PB, _QB = (0.5, 0.3, 0.2), (0.4, 0.1, 0.5)
_MB = (0.45, 0.2, 0.35)
_HAND_TAIL = {
    "forward_kl": sum(a * math.log(a / b) for a, b in zip(_PB, _QB, strict=True)),
    "reverse_kl": sum(b * math.log(b / a) for a, b in zip(_PB, _QB, strict=True)),
    "jsd": 0.5 * sum(a * math.log(a / m) for a, m in zip(_PB, _MB, strict=True))
    + 0.5 * sum(b * math.log(b / m) for b, m in zip(_QB, _MB, strict=True)),
    "tvd": 0.5 * (0.1 + 0.2 + 0.3),
}


@pytest.mark.parametrize("name", sorted(_HAND_TAIL))
def test_tail_bucket_holds_unlogged_mass_of_both_models(name):
    logits, ids, probs, mask = _as_batch([0.1, 0.2, 0.3, 0.4], [3, 0], [0.5, 0.3])
    loss = distillation_loss(name, logits, ids, probs, mask)
    torch.testing.assert_close(loss.item(), _HAND_TAIL[name], rtol=1e-5, atol=1e-6)


def test_buckets_put_draft_tail_mass_last_and_exact():
    logits, ids, probs, _ = _as_batch([0.1, 0.2, 0.3, 0.4], [3, 0], [0.5, 0.3])
    target_probs, draft_log_probs, has_tail = top_m_buckets(logits, ids, probs)
    torch.testing.assert_close(target_probs, torch.tensor([[[0.5, 0.3, 0.2]]]))
    torch.testing.assert_close(draft_log_probs.exp(), torch.tensor([[[0.4, 0.1, 0.5]]]))
    assert has_tail.tolist() == [[True]]


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_all_ids_logged_equals_full_vocabulary_reference(name):
    logits, target_probs = _random_case(2, 5, 7, seed=0)
    ids, probs = _top_m(target_probs, 7)
    mask = torch.ones(2, 5, dtype=torch.bool)
    loss = distillation_loss(name, logits, ids, probs, mask)
    expected = _reference(name, logits, target_probs).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_all_ids_logged_gradients_equal_full_vocabulary_reference(name):
    logits, target_probs = _random_case(2, 3, 5, seed=1)
    ids, probs = _top_m(target_probs, 5)
    ours = logits.clone().requires_grad_(True)
    reference = logits.double().requires_grad_(True)
    distillation_loss(name, ours, ids, probs, torch.ones(2, 3, dtype=torch.bool)).backward()
    _reference(name, reference, target_probs).mean().backward()
    torch.testing.assert_close(ours.grad.double(), reference.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("num_top", [1, 3, 6])
def test_top_m_loss_never_exceeds_full_vocabulary_divergence(name, num_top):
    # Bucketing coarsens both distributions: the data-processing inequality bounds every
    # divergence here by its full-vocabulary value.
    logits, target_probs = _random_case(3, 4, 8, seed=num_top)
    ids, probs = _top_m(target_probs, num_top)
    per_position = [
        distillation_loss(
            name,
            logits[b : b + 1, t : t + 1],
            ids[b : b + 1, t : t + 1],
            probs[b : b + 1, t : t + 1],
            torch.ones(1, 1, dtype=torch.bool),
        )
        for b in range(3)
        for t in range(4)
    ]
    full = _reference(name, logits, target_probs).flatten()
    assert all(
        loss.item() <= ref.item() + 1e-6 for loss, ref in zip(per_position, full, strict=True)
    )


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_mean_is_over_masked_positions_only(name):
    logits, target_probs = _random_case(2, 6, 5, seed=3)
    ids, probs = _top_m(target_probs, 5)
    mask = torch.tensor([[True, False, True, False, False, True], [False] * 5 + [True]])
    # Masked positions hold garbage: duplicate padding ids and probabilities far from a
    # distribution. Neither the value nor the gradients may notice.
    ids = torch.where(mask.unsqueeze(-1), ids, torch.zeros_like(ids))
    probs = torch.where(mask.unsqueeze(-1), probs, torch.full_like(probs, 7.0))
    logits.requires_grad_(True)
    loss = distillation_loss(name, logits, ids, probs, mask)
    expected = _reference(name, logits.detach(), target_probs)[mask].mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[~mask] == 0).all()


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_all_masked_returns_zero_with_finite_gradients(name):
    logits, target_probs = _random_case(2, 3, 5, seed=4)
    ids, probs = _top_m(target_probs, 2)
    logits.requires_grad_(True)
    loss = distillation_loss(name, logits, ids, probs, torch.zeros(2, 3, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_zero_probabilities_and_fp16_sums_above_one_keep_gradients_finite(name):
    logits = torch.randn(1, 3, 6, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    ids = torch.tensor([[[0, 1, 2], [3, 4, 5], [5, 0, 1]]])
    probs = torch.tensor(
        [[[0.7, 0.0, 0.0], [0.6, 0.3, 0.2], [1.0, 0.0, 0.0]]], dtype=torch.float16
    )  # sums 0.7, 1.1 (above 1), 1.0 with zeros
    loss = distillation_loss(name, logits, ids, probs, torch.ones(1, 3, dtype=torch.bool))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_all_ids_logged_with_fp16_rounding_stays_finite(name):
    # m == V with fp16 probabilities that do not sum to exactly 1: the draft's tail is empty,
    # so the target's rounding error must not become a tail bucket (an infinite forward KL).
    logits, target_probs = _random_case(1, 4, 6, seed=6)
    ids, probs = _top_m(target_probs, 6)
    logits.requires_grad_(True)
    loss = distillation_loss(name, logits, ids, probs.half(), torch.ones(1, 4, dtype=torch.bool))
    loss.backward()
    expected = _reference(name, logits.detach(), target_probs).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=2e-3, atol=2e-3)
    assert torch.isfinite(logits.grad).all()


def test_reverse_kl_reads_a_logged_zero_as_the_smallest_fp16_probability():
    logits, ids, probs, mask = _as_batch([0.5, 0.5], [0, 1], [1.0, 0.0])
    loss = distillation_loss("reverse_kl", logits, ids, probs, mask)
    expected = 0.5 * math.log(0.5) + 0.5 * math.log(0.5 / MIN_TARGET_PROB)
    torch.testing.assert_close(loss.item(), expected, rtol=1e-5, atol=1e-6)


def test_jsd_is_symmetric_at_beta_one_half():
    logits_a, _ = _random_case(2, 3, 6, seed=7)
    logits_b, _ = _random_case(2, 3, 6, seed=8)
    mask = torch.ones(2, 3, dtype=torch.bool)

    def jsd(draft_logits, target_logits):
        ids, probs = _top_m(torch.softmax(target_logits, dim=-1), 6)
        return jsd_loss(draft_logits, ids, probs, mask, beta=0.5)

    torch.testing.assert_close(
        jsd(logits_a, logits_b), jsd(logits_b, logits_a), rtol=1e-5, atol=1e-6
    )


def test_jsd_is_asymmetric_away_from_one_half():
    # Negative control for the symmetry test above.
    logits_a, _ = _random_case(1, 3, 6, seed=7)
    logits_b, _ = _random_case(1, 3, 6, seed=8)
    mask = torch.ones(1, 3, dtype=torch.bool)
    ids_b, probs_b = _top_m(torch.softmax(logits_b, -1), 6)
    ids_a, probs_a = _top_m(torch.softmax(logits_a, -1), 6)
    forward = jsd_loss(logits_a, ids_b, probs_b, mask, beta=0.1)
    backward = jsd_loss(logits_b, ids_a, probs_a, mask, beta=0.1)
    assert abs(forward.item() - backward.item()) > 1e-3


def test_tvd_equals_one_minus_acceptance_when_all_ids_are_logged():
    logits, target_probs = _random_case(2, 5, 6, seed=9)
    ids, probs = _top_m(target_probs, 6)
    mask = torch.ones(2, 5, dtype=torch.bool)
    lower, upper = acceptance_bounds(logits, ids, probs)
    torch.testing.assert_close(
        tvd_loss(logits, ids, probs, mask), 1 - lower.mean(), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(lower, upper)


def test_tvd_equals_one_minus_upper_acceptance_bound_with_a_tail():
    logits, target_probs = _random_case(2, 5, 8, seed=9)
    ids, probs = _top_m(target_probs, 3)
    mask = torch.ones(2, 5, dtype=torch.bool)
    _, upper = acceptance_bounds(logits, ids, probs)
    torch.testing.assert_close(
        tvd_loss(logits, ids, probs, mask), 1 - upper.mean(), rtol=1e-5, atol=1e-6
    )


def test_low_precision_logits_are_reduced_in_fp32():
    logits, target_probs = _random_case(1, 4, 6, seed=10)
    ids, probs = _top_m(target_probs, 6)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss = distillation_loss("forward_kl", logits.bfloat16(), ids, probs, mask)
    assert loss.dtype == torch.float32
    expected = _reference("forward_kl", logits.bfloat16().float(), target_probs).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "kl"}, "unknown distillation loss 'kl'"),
        ({"name": "jsd", "jsd_beta": 1.0}, "beta must be in"),
        ({"ids": torch.tensor([[[0, 9]]])}, "must be in \\[0, 3\\), got min 0 max 9"),
        ({"ids": torch.tensor([[[0, 1, 2, 0]]])}, "1 <= m <= V"),
        ({"probs": torch.tensor([[[0.5]]])}, "must have the shape of target_top_ids"),
        ({"mask": torch.ones(1, 2, dtype=torch.bool)}, "mask must be a bool"),
        ({"mask": torch.ones(1, 1)}, "mask must be a bool"),
        ({"ids": torch.tensor([[[0.0, 1.0]]])}, "must hold integers"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_value(kwargs, match):
    args = {
        "name": "forward_kl",
        "logits": torch.zeros(1, 1, 3),
        "ids": torch.tensor([[[0, 1]]]),
        "probs": torch.tensor([[[0.5, 0.2]]]),
        "mask": torch.ones(1, 1, dtype=torch.bool),
        "jsd_beta": 0.5,
    } | kwargs
    if args["ids"].shape != args["probs"].shape and "probs" not in kwargs:
        args["probs"] = torch.full(args["ids"].shape, 0.1)
    with pytest.raises(ValueError, match=match):
        distillation_loss(
            args["name"],
            args["logits"],
            args["ids"],
            args["probs"],
            args["mask"],
            jsd_beta=args["jsd_beta"],
        )
