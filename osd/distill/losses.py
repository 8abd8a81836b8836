"""Distillation losses between the logged target distribution and the draft, over top-m buckets.

Online speculative decoding (Liu et al. 2023, arXiv 2310.07177) distils the draft towards the
target on live traffic; docs/algorithms.md, "Distillation losses", lists the divergences. In the
usual distillation vocabulary the target is the teacher and the draft the student; this module says
target/draft like the rest of the project.

The replicas log only the target's top-m probabilities at temperature 1
(`osd.buffer.record.Record`), so every loss here compares two distributions over **m + 1
buckets**: the m logged token ids, and one "tail" bucket holding everything else. The target's
tail mass is `1 - sum(top-m p)` (clamped at 0, since fp16 probabilities may sum slightly above
1); the draft's is its exact mass outside the logged ids, from a logsumexp over the complement
(no cancellation in `1 - sum q`). This is a coarsening of the vocabulary, so every divergence
here is a lower bound of the full-vocabulary one (data-processing inequality) and equals it
when m == V, where the tail bucket is empty.

Pure: torch only. The draft's log-softmax is computed in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "LossName",
    "distillation_loss",
    "forward_kl_loss",
    "jsd_loss",
    "masked_mean",
    "reverse_kl_loss",
    "top_m_buckets",
    "tvd_loss",
]

LossName = Literal["forward_kl", "reverse_kl", "jsd", "tvd"]

# fp16 logging rounds probabilities below 2**-25 to 0. Where a divergence needs log p (reverse
# KL), a logged 0 is read as the smallest positive fp16 value instead of -inf: the true
# probability was at most about that, and the loss and its gradient stay finite.
MIN_TARGET_PROB = 2.0**-24


def _check_inputs(
    draft_logits: Tensor, target_top_ids: Tensor, target_top_probs: Tensor, mask: Tensor | None
) -> None:
    if draft_logits.dim() != 3 or not draft_logits.is_floating_point():
        raise ValueError(
            f"draft_logits must be a floating (B, T, V) tensor, got {draft_logits.dtype} "
            f"shape {tuple(draft_logits.shape)}"
        )
    batch, num_positions, vocab_size = draft_logits.shape
    if target_top_ids.dim() != 3 or tuple(target_top_ids.shape[:2]) != (batch, num_positions):
        raise ValueError(
            f"target_top_ids must be (B, T, m) = ({batch}, {num_positions}, m), "
            f"got shape {tuple(target_top_ids.shape)}"
        )
    if target_top_ids.is_floating_point() or target_top_ids.dtype == torch.bool:
        raise ValueError(f"target_top_ids must hold integers, got dtype {target_top_ids.dtype}")
    if target_top_probs.shape != target_top_ids.shape:
        raise ValueError(
            f"target_top_probs must have the shape of target_top_ids "
            f"{tuple(target_top_ids.shape)}, got {tuple(target_top_probs.shape)}"
        )
    num_top = target_top_ids.shape[-1]
    if not 1 <= num_top <= vocab_size:
        raise ValueError(f"need 1 <= m <= V = {vocab_size} logged ids per position, got {num_top}")
    if target_top_ids.numel():
        low, high = int(target_top_ids.min()), int(target_top_ids.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"target_top_ids must be in [0, {vocab_size}), got min {low} max {high}"
            )
    if mask is not None and (mask.shape != (batch, num_positions) or mask.dtype != torch.bool):
        raise ValueError(
            f"mask must be a bool (B, T) = ({batch}, {num_positions}) tensor, got {mask.dtype} "
            f"shape {tuple(mask.shape)}"
        )


def top_m_buckets(
    draft_logits: Tensor, target_top_ids: Tensor, target_top_probs: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Both distributions over the m logged ids plus one tail bucket.

    Args:
        draft_logits: (B, T, V) finite draft logits, any float dtype.
        target_top_ids: (B, T, m) logged target token ids, distinct within a position (masked
            positions may hold any valid id, e.g. padding 0).
        target_top_probs: (B, T, m) their target probabilities at temperature 1.

    Returns:
        `(target_probs, draft_log_probs, has_tail)`: (B, T, m+1) fp32 target probabilities with
        the tail last; (B, T, m+1) fp32 draft log-probabilities, finite everywhere (a position
        with no tail, m == V, gets a placeholder 0 there and target tail mass 0); and (B, T) bool,
        whether a position has a non-empty tail.
    """
    _check_inputs(draft_logits, target_top_ids, target_top_probs, None)
    return _buckets(draft_logits, target_top_ids, target_top_probs)


def _buckets(
    draft_logits: Tensor, target_top_ids: Tensor, target_top_probs: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    ids = target_top_ids.long()
    draft_log_probs = torch.log_softmax(draft_logits.float(), dim=-1)  # (B, T, V)
    top_log_probs = draft_log_probs.gather(-1, ids)  # (B, T, m)

    in_top = torch.zeros_like(draft_log_probs, dtype=torch.bool).scatter_(-1, ids, True)
    has_tail = ~in_top.all(dim=-1)  # (B, T)
    # Positions without a tail would give logsumexp(-inf, ..., -inf) = -inf and a NaN gradient:
    # feed them zeros instead and overwrite the result.
    complement = draft_log_probs.masked_fill(in_top, -math.inf)
    complement = torch.where(has_tail.unsqueeze(-1), complement, torch.zeros_like(complement))
    tail_log_prob = torch.logsumexp(complement, dim=-1)  # (B, T)
    tail_log_prob = torch.where(has_tail, tail_log_prob, torch.zeros_like(tail_log_prob))

    top_probs = target_top_probs.float().clamp(min=0.0)  # (B, T, m)
    tail_prob = (1.0 - top_probs.sum(dim=-1)).clamp(min=0.0)  # (B, T)
    tail_prob = torch.where(has_tail, tail_prob, torch.zeros_like(tail_prob))

    target_probs = torch.cat([top_probs, tail_prob.unsqueeze(-1)], dim=-1)  # (B, T, m+1)
    log_probs = torch.cat([top_log_probs, tail_log_prob.unsqueeze(-1)], dim=-1)  # (B, T, m+1)
    return target_probs, log_probs, has_tail


def _bucket_valid(has_tail: Tensor, num_buckets: int) -> Tensor:
    """(B, T, m+1) bool: every logged bucket, and the tail where it is non-empty."""
    valid = torch.ones(*has_tail.shape, num_buckets, dtype=torch.bool, device=has_tail.device)
    valid[..., -1] = has_tail
    return valid


def _sum_valid(terms: Tensor, has_tail: Tensor) -> Tensor:
    """Sums (B, T, m+1) per-bucket terms over the valid buckets -> (B, T)."""
    valid = _bucket_valid(has_tail, terms.shape[-1])
    return torch.where(valid, terms, torch.zeros_like(terms)).sum(dim=-1)


def _kl_target_draft(target_probs: Tensor, draft_log_probs: Tensor) -> Tensor:
    """Per bucket p (log p - log q); 0 where p == 0 (0 log 0 = 0)."""
    return torch.xlogy(target_probs, target_probs) - target_probs * draft_log_probs


def _forward_kl(p: Tensor, log_q: Tensor, has_tail: Tensor) -> Tensor:
    return _sum_valid(_kl_target_draft(p, log_q), has_tail)


def _reverse_kl(p: Tensor, log_q: Tensor, has_tail: Tensor) -> Tensor:
    log_p = torch.log(p.clamp(min=MIN_TARGET_PROB))
    return _sum_valid(log_q.exp() * (log_q - log_p), has_tail)


def _jsd(p: Tensor, log_q: Tensor, has_tail: Tensor, beta: float) -> Tensor:
    # log m = logaddexp(log beta + log p, log(1 - beta) + log q); finite since log q is finite.
    log_mix = torch.logaddexp(math.log(beta) + torch.log(p), math.log1p(-beta) + log_q)
    target_term = _kl_target_draft(p, log_mix)
    draft_term = log_q.exp() * (log_q - log_mix)
    return _sum_valid(beta * target_term + (1.0 - beta) * draft_term, has_tail)


def _tvd(p: Tensor, log_q: Tensor, has_tail: Tensor) -> Tensor:
    return 0.5 * _sum_valid((p - log_q.exp()).abs(), has_tail)


def masked_mean(per_position: Tensor, mask: Tensor) -> Tensor:
    """Mean of (B, T) values over the positions where `mask` is True; 0 (with zero gradients,
    never NaN) when none is."""
    kept = torch.where(mask, per_position, torch.zeros_like(per_position))
    num_kept = mask.sum()
    if num_kept == 0:
        # Explicit all-masked branch: still connected to the graph, so backward() works.
        return kept.sum() * 0.0
    return kept.sum() / num_kept


def _loss(
    name: LossName,
    draft_logits: Tensor,
    target_top_ids: Tensor,
    target_top_probs: Tensor,
    mask: Tensor,
    beta: float,
) -> Tensor:
    _check_inputs(draft_logits, target_top_ids, target_top_probs, mask)
    p, log_q, has_tail = _buckets(draft_logits, target_top_ids, target_top_probs)
    if name == "forward_kl":
        per_position = _forward_kl(p, log_q, has_tail)
    elif name == "reverse_kl":
        per_position = _reverse_kl(p, log_q, has_tail)
    elif name == "jsd":
        per_position = _jsd(p, log_q, has_tail, beta)
    else:
        per_position = _tvd(p, log_q, has_tail)
    return masked_mean(per_position, mask)


def forward_kl_loss(
    draft_logits: Tensor, target_top_ids: Tensor, target_top_probs: Tensor, mask: Tensor
) -> Tensor:
    """Forward KL `sum p log(p / q)` over the top-m + tail buckets (mass-covering; OSD's default).

    Args:
        draft_logits: (B, T, V) draft logits at the positions the target's distribution was
            logged for.
        target_top_ids: (B, T, m) logged target token ids (any integer dtype).
        target_top_probs: (B, T, m) their target probabilities (fp16 as logged is fine).
        mask: (B, T) bool, the positions that count.

    Returns:
        Scalar fp32 mean over the masked positions; 0 when no position counts.
    """
    return _loss("forward_kl", draft_logits, target_top_ids, target_top_probs, mask, 0.5)


def reverse_kl_loss(
    draft_logits: Tensor, target_top_ids: Tensor, target_top_probs: Tensor, mask: Tensor
) -> Tensor:
    """Reverse KL `sum q log(q / p)` over the top-m + tail buckets (mode-seeking).

    A logged probability of 0 (or an empty target tail) counts as `MIN_TARGET_PROB`, so draft
    mass there is penalised heavily but finitely. Args and returns as in `forward_kl_loss`.
    """
    return _loss("reverse_kl", draft_logits, target_top_ids, target_top_probs, mask, 0.5)


def jsd_loss(
    draft_logits: Tensor,
    target_top_ids: Tensor,
    target_top_probs: Tensor,
    mask: Tensor,
    beta: float = 0.5,
) -> Tensor:
    """Generalised Jensen-Shannon `beta KL(p || m) + (1 - beta) KL(q || m)`, `m = beta p +
    (1 - beta) q`, over the top-m + tail buckets.

    Args:
        beta: weight of the target in the mixture, in (0, 1); 0.5 is the symmetric JSD.
        Others as in `forward_kl_loss`.
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    return _loss("jsd", draft_logits, target_top_ids, target_top_probs, mask, beta)


def tvd_loss(
    draft_logits: Tensor, target_top_ids: Tensor, target_top_probs: Tensor, mask: Tensor
) -> Tensor:
    """Total variation `1/2 sum |p - q|` over the top-m + tail buckets.

    Per position this is `1 - beta` of docs/algorithms.md, "Acceptance estimates" (when
    m == V), the quantity token acceptance depends on (DistillSpec, arXiv 2310.08461). Args and
    returns as in `forward_kl_loss`.
    """
    return _loss("tvd", draft_logits, target_top_ids, target_top_probs, mask, 0.5)


def distillation_loss(
    name: LossName,
    draft_logits: Tensor,
    target_top_ids: Tensor,
    target_top_probs: Tensor,
    mask: Tensor,
    *,
    jsd_beta: float = 0.5,
) -> Tensor:
    """The loss called `name` ("forward_kl", "reverse_kl", "jsd" or "tvd"), as configured.

    Args:
        name: which divergence.
        jsd_beta: the JSD's beta; ignored by the others.
        Others as in `forward_kl_loss`.

    Raises:
        ValueError: unknown `name`, bad shapes or ids, or `jsd_beta` outside (0, 1).
    """
    if name not in get_args(LossName):
        raise ValueError(f"unknown distillation loss {name!r}; choose from {get_args(LossName)}")
    if name == "jsd":
        return jsd_loss(draft_logits, target_top_ids, target_top_probs, mask, jsd_beta)
    return _loss(name, draft_logits, target_top_ids, target_top_probs, mask, 0.5)
