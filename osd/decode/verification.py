"""Lossless verifiers: token, block and SpecTr K-SEQ verification of drafted tokens.

Each verifier decides how many drafted tokens to keep and the distribution of the one token
that follows them (a *recovered* token after a rejection, a *bonus* token after a full
acceptance), such that the emitted tokens are distributed exactly as if the target had sampled
them one at a time. See docs/algorithms.md ("Token verification", "Block verification",
"SpecTr K-SEQ"); papers: Leviathan et al. 2023 (arXiv 2211.17192), Block Verification (Sun et
al. 2024, arXiv 2403.10444), SpecTr (Sun et al. 2023, arXiv 2310.15141).

All functions are pure and batched over a leading dimension B. Random numbers are passed in as
uniforms, so tests can drive every decision. ``p`` is always the target, ``q`` the draft, and
both are the post-processing distributions the tokens were sampled from
(:func:`osd.decode.sampling.logits_to_probs`); greedy decoding is the one-hot case and needs no
special path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from osd.decode.sampling import sample_from_probs

__all__ = [
    "VerifyOutput",
    "block_acceptance_probs",
    "block_verify",
    "kseq_step",
    "solve_kseq_rho",
    "spectr_verify",
    "token_acceptance_probs",
    "token_verify",
]

# Bisection steps for rho*: exactness does not depend on it (see kseq_step), only efficiency.
_RHO_BISECTION_STEPS = 30


@dataclass(frozen=True)
class VerifyOutput:
    """What a verifier decided for each row of the batch.

    Attributes:
        num_accepted: (B,) int64, drafted tokens kept (a prefix of the chosen draft).
        next_token_ids: (B,) int64, the recovered or bonus token emitted after them.
        next_token_probs: (B, V) the distribution ``next_token_ids`` was drawn from.
        draft_index: (B,) int64, the draft sequence whose prefix was kept (0 for one draft).
    """

    num_accepted: torch.Tensor
    next_token_ids: torch.Tensor
    next_token_probs: torch.Tensor
    draft_index: torch.Tensor


def _rows(probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, N, V) and (B,) -> (B, V): row ``index[b]`` of each batch entry."""
    return probs[torch.arange(probs.shape[0], device=probs.device), index]


def _normalize_or(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Normalises (B, V) weights per row; rows with no mass take the fallback distribution.

    A zero-mass residual has probability zero of being needed in exact arithmetic; the fallback
    only guards against rounding.
    """
    total = weights.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(1e-30), fallback)


def _mask_ragged(
    draft_probs: torch.Tensor, accept_uniforms: torch.Tensor, num_draft_tokens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows that drafted fewer than k tokens (a ragged batch padded to k).

    Beyond a row's own count its q is zero and its draws lie above every acceptance
    probability, so nothing there is kept, and the residual at the first padded position is
    ``normalize(p)``: exactly the bonus distribution. A row with count 0 samples from p_1
    (speculation off for that row).

    Returns:
        ``(draft_probs, accept_uniforms, padded)``; ``padded`` is (B, k) bool or None.
    """
    if num_draft_tokens is None:
        return draft_probs, accept_uniforms, None
    k = draft_probs.shape[1]
    positions = torch.arange(k, device=draft_probs.device)
    padded = positions >= num_draft_tokens.unsqueeze(-1)  # (B, k)
    draft_probs = draft_probs.masked_fill(padded.unsqueeze(-1), 0.0)
    return draft_probs, accept_uniforms.masked_fill(padded, 2.0), padded


def _check_shapes(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor):
    """Drafts (..., k), their q (..., k, V) and the target's p (..., k + 1, V) must line up."""
    *lead, k = draft_ids.shape
    if draft_probs.shape[:-1] != draft_ids.shape or target_probs.shape[:-1] != (*lead, k + 1):
        raise ValueError(
            f"shape mismatch: draft_ids {tuple(draft_ids.shape)}, draft_probs "
            f"{tuple(draft_probs.shape)}, target_probs {tuple(target_probs.shape)}; expected "
            "(..., k), (..., k, V), (..., k + 1, V)"
        )


def _drafted_token_probs(
    draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p_i(x_i), q_i(x_i))``, each (B, k): what every single-draft verifier decides on."""
    _check_shapes(draft_ids, draft_probs, target_probs)
    index = draft_ids.unsqueeze(-1)  # (B, k, 1)
    p_x = target_probs[:, : draft_ids.shape[1]].gather(-1, index).squeeze(-1)
    return p_x, draft_probs.gather(-1, index).squeeze(-1)


def _emit(
    num_accepted: torch.Tensor,
    next_probs: torch.Tensor,
    sample_uniforms: torch.Tensor,
    draft_index: torch.Tensor,
) -> VerifyOutput:
    """Samples the recovered or bonus token from ``next_probs``: every verifier's last act."""
    next_ids = sample_from_probs(next_probs, sample_uniforms)
    return VerifyOutput(num_accepted, next_ids, next_probs, draft_index)


def _recover_or_bonus(
    num_accepted: torch.Tensor,
    weight: torch.Tensor | float,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> VerifyOutput:
    """The tail token and block verification share, once ``tau`` tokens are kept.

    ``tau < k``: ``y ~ normalize(max(w_tau p_{tau+1} - q_{tau+1}, 0))``; ``tau = k``:
    ``y ~ p_{k+1}``. Token verification is the case ``w_tau = 1`` (docs/algorithms.md, "Block
    verification"), and ``1.0 * p`` is ``p`` to the bit. ``num_accepted`` (B,) is tau,
    ``weight`` (B, 1) ``w_tau`` or 1.0; the rest as in :func:`token_verify`.
    """
    k = draft_probs.shape[1]
    p_next = _rows(target_probs, num_accepted)  # (B, V)
    q_next = _rows(draft_probs, num_accepted.clamp(max=k - 1))  # (B, V)
    residual = _normalize_or((weight * p_next - q_next).clamp_min(0), p_next)
    next_probs = torch.where((num_accepted < k).unsqueeze(-1), residual, p_next)
    return _emit(num_accepted, next_probs, sample_uniforms, torch.zeros_like(num_accepted))


def token_acceptance_probs(
    draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> torch.Tensor:
    """Probability that token verification accepts each drafted token, ``min(1, p/q)``.

    Args:
        draft_ids: (B, k) drafted tokens.
        draft_probs: (B, k, V) q_i, the distribution each drafted token was sampled from.
        target_probs: (B, k + 1, V) p_1..p_{k+1}.

    Returns:
        (B, k) acceptance probability of each drafted token, given the ones before it.
    """
    p_x, q_x = _drafted_token_probs(draft_ids, draft_probs, target_probs)  # (B, k) each
    return torch.where(q_x > 0, (p_x / q_x.clamp_min(1e-30)).clamp(max=1.0), 1.0)


def token_verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
) -> VerifyOutput:
    """Token verification: accept x_i while u_i < p_i(x_i)/q_i(x_i); then recover or bonus.

    Args:
        draft_ids: (B, k) drafted tokens.
        draft_probs: (B, k, V) q_i.
        target_probs: (B, k + 1, V) p_1..p_{k+1}.
        accept_uniforms: (B, k) U[0, 1) draws, one per drafted token.
        sample_uniforms: (B,) U[0, 1) draws for the recovered or bonus token.
        num_draft_tokens: (B,) tokens each row really drafted (<= k; 0 is the target alone);
            None: all k. Positions beyond are padding and never kept.

    Returns:
        A :class:`VerifyOutput`.
    """
    draft_probs, accept_uniforms, _ = _mask_ragged(draft_probs, accept_uniforms, num_draft_tokens)
    accept_probs = token_acceptance_probs(draft_ids, draft_probs, target_probs)  # (B, k)
    rejected = accept_uniforms >= accept_probs  # (B, k)
    k = draft_ids.shape[1]
    num_accepted = torch.where(rejected.any(dim=-1), rejected.int().argmax(dim=-1), k)  # (B,)
    return _recover_or_bonus(num_accepted, 1.0, draft_probs, target_probs, sample_uniforms)


def block_acceptance_probs(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    padded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights ``w_i`` and stopping probabilities ``h_i`` of block verification.

    Args:
        draft_ids: (B, k) drafted tokens.
        draft_probs: (B, k, V) q_i.
        target_probs: (B, k + 1, V) p_1..p_{k+1}.
        padded: (B, k) bool, positions beyond a row's own draft (see :func:`_mask_ragged`).

    Returns:
        ``(w, h)``, each (B, k): ``w_i = min(1, w_{i-1} p_i(x_i)/q_i(x_i))``, and ``h_i``, the
        probability of keeping exactly ``i`` tokens given that no longer prefix is kept
        (``tau`` = largest ``i`` with ``eta_i < h_i``).
    """
    p_x, q_x = _drafted_token_probs(draft_ids, draft_probs, target_probs)  # (B, k) each
    k = draft_ids.shape[1]
    log_ratio = torch.log(p_x) - torch.log(q_x)  # (B, k); -inf where p_x = 0
    if padded is not None:
        log_ratio = log_ratio.masked_fill(padded, 0.0)
    log_w = torch.zeros_like(log_ratio[:, 0])
    log_ws = []
    for i in range(k):  # w recovers after a low ratio: a running product capped at 1
        log_w = (log_w + log_ratio[:, i]).clamp(max=0.0)
        log_ws.append(log_w)
    w = torch.stack(log_ws, dim=1).exp()  # (B, k)
    residual_mass = (w[:, :-1, None] * target_probs[:, 1:k] - draft_probs[:, 1:k]).clamp_min(0)
    z = residual_mass.sum(dim=-1)  # (B, k - 1)
    denominator = z + 1.0 - w[:, :-1]
    h = torch.where(denominator > 0, z / denominator.clamp_min(1e-30), 1.0)
    h = torch.cat([h, w[:, -1:]], dim=1)  # (B, k)
    if padded is not None:  # a row's last own position is its h_k = w_k
        last = ~padded & torch.cat([padded[:, 1:], torch.ones_like(padded[:, :1])], dim=1)
        h = torch.where(last, w, h)
    return w, h


def block_verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
) -> VerifyOutput:
    """Block verification: keep the longest prefix ``i`` with ``eta_i < h_i``; then sample.

    Never keeps fewer tokens in expectation than token verification (Sun et al. 2024).
    Arguments and result as in :func:`token_verify`; ``accept_uniforms`` are the ``eta_i``.
    """
    draft_probs, accept_uniforms, padded = _mask_ragged(
        draft_probs, accept_uniforms, num_draft_tokens
    )
    w, h = block_acceptance_probs(draft_ids, draft_probs, target_probs, padded)  # (B, k) each
    lengths = torch.arange(1, draft_ids.shape[1] + 1, device=draft_ids.device)
    num_accepted = ((accept_uniforms < h) * lengths).amax(dim=-1)  # (B,) tau
    w_kept = torch.cat([torch.ones_like(w[:, :1]), w], dim=1)  # (B, k + 1), w_0 = 1
    weight = w_kept.gather(1, num_accepted.unsqueeze(1))  # (B, 1)
    return _recover_or_bonus(num_accepted, weight, draft_probs, target_probs, sample_uniforms)


def _kseq_beta(target: torch.Tensor, draft: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """beta(rho) = sum_x min(q(x), p(x)/rho); (B, V), (B, V), (B,) -> (B,)."""
    return torch.minimum(draft, target / rho.unsqueeze(-1)).sum(dim=-1)


def solve_kseq_rho(
    target: torch.Tensor, draft: torch.Tensor, num_candidates: torch.Tensor
) -> torch.Tensor:
    """Solves ``1 - (1 - beta(rho))^K = rho * beta(rho)`` for rho in [1, K] by bisection.

    Returns the upper end of the final bracket, where ``1 - (1-beta)^K <= rho * beta``; that
    side keeps :func:`kseq_step` exact whatever the bracket's width.

    Args:
        target: (B, V) p.
        draft: (B, V) q.
        num_candidates: (B,) K per row (>= 1).

    Returns:
        (B,) rho.
    """
    num_candidates = num_candidates.to(target.dtype)
    lo = torch.ones_like(num_candidates)
    hi = num_candidates.clone()
    for _ in range(_RHO_BISECTION_STEPS):
        mid = (lo + hi) / 2
        beta = _kseq_beta(target, draft, mid)
        above = 1 - (1 - beta) ** num_candidates > mid * beta  # root lies above mid
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    return hi


def kseq_step(
    target: torch.Tensor,
    draft: torch.Tensor,
    candidate_ids: torch.Tensor,
    alive: torch.Tensor,
    accept_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One position of K-SEQ: accept the first candidate that passes, else a residual.

    The alive candidates must be i.i.d. draws from ``draft``. Candidate ``j`` passes with
    probability ``min(1, p(x_j) / (rho q(x_j)))``. Token x is then emitted by acceptance with
    probability ``a(x) = min(q(x), p(x)/rho) * (1 - (1-beta)^K) / beta`` <= p(x) (by the choice
    of rho in :func:`solve_kseq_rho`), and the residual ``normalize(p - a)`` supplies the rest,
    so the emitted token is distributed exactly as ``p``.

    Args:
        target: (B, V) p at this position.
        draft: (B, V) q at this position.
        candidate_ids: (B, K) candidate tokens (only alive ones matter).
        alive: (B, K) bool, which candidates take part (at least one per row).
        accept_uniforms: (B, K) U[0, 1) draws.

    Returns:
        ``(accepted_index, accept_probs, residual_probs)``: (B,) index of the first accepted
        candidate or -1 if none; (B, K) each candidate's pass probability (0 if not alive);
        (B, V) the distribution to sample from when none is accepted.
    """
    num_candidates = alive.sum(dim=-1)  # (B,)
    rho = solve_kseq_rho(target, draft, num_candidates)  # (B,)
    p_x = target.gather(-1, candidate_ids)  # (B, K)
    q_x = draft.gather(-1, candidate_ids)  # (B, K)
    scaled_q = rho.unsqueeze(-1) * q_x
    pass_probs = torch.where(scaled_q > 0, (p_x / scaled_q.clamp_min(1e-30)).clamp(max=1.0), 1.0)
    accept_probs = torch.where(alive, pass_probs, 0.0)
    passed = accept_uniforms < accept_probs  # (B, K)
    accepted_index = torch.where(passed.any(dim=-1), passed.int().argmax(dim=-1), -1)

    beta = _kseq_beta(target, draft, rho)  # (B,)
    k_float = num_candidates.to(target.dtype)
    # P(some candidate accepted) / beta, with its limit K as beta -> 0.
    scale = torch.where(beta > 0, (1 - (1 - beta) ** k_float) / beta.clamp_min(1e-30), k_float)
    accepted_mass = torch.minimum(draft, target / rho.unsqueeze(-1)) * scale.unsqueeze(-1)
    residual = (target - accepted_mass.minimum(target)).clamp_min(0)
    return accepted_index, accept_probs, _normalize_or(residual, target)


def spectr_verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
    num_drafts: torch.Tensor | None = None,
) -> VerifyOutput:
    """SpecTr K-SEQ over K independently drafted sequences (a tree where prefixes coincide).

    At depth t, K-SEQ runs over the next tokens of the drafts that agree with the kept prefix;
    the drafts that agree with the emitted token stay alive. The first residual sample ends the
    step; passing depth k earns a bonus token from the target. K = 1 is token verification.

    Args:
        draft_ids: (B, K, k) drafted sequences.
        draft_probs: (B, K, k, V) q along each sequence.
        target_probs: (B, K, k + 1, V) p along each sequence.
        accept_uniforms: (B, K, k) U[0, 1) draws.
        sample_uniforms: (B,) U[0, 1) draws for the recovered or bonus token.
        num_draft_tokens: (B,) each row's own k (<= k); None: all k.
        num_drafts: (B,) each row's own K (<= K; its first drafts); None: all K.

    Returns:
        A :class:`VerifyOutput`; ``draft_index`` names a draft whose first ``num_accepted``
        tokens were kept (its target rows are the ones to log).
    """
    _check_shapes(draft_ids, draft_probs, target_probs)
    batch, width, k = draft_ids.shape
    device = draft_ids.device
    alive = torch.ones(batch, width, dtype=torch.bool, device=device)
    if num_drafts is not None:
        alive = torch.arange(width, device=device) < num_drafts.unsqueeze(-1)
    own_k = torch.full((batch,), k, device=device) if num_draft_tokens is None else num_draft_tokens
    running = torch.ones(batch, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    next_probs = torch.zeros_like(target_probs[:, 0, 0])  # (B, V)
    for depth in range(k):
        # Alive drafts share the kept prefix, so any of them carries p and q for it.
        representative = alive.int().argmax(dim=-1)  # (B,)
        target = _rows(target_probs[:, :, depth], representative)  # (B, V)
        at_end = running & (own_k <= depth)  # passed its own k: the bonus token
        next_probs = torch.where(at_end.unsqueeze(-1), target, next_probs)
        running = running & ~at_end
        draft = _rows(draft_probs[:, :, depth], representative)  # (B, V)
        candidates = draft_ids[:, :, depth]  # (B, K)
        accepted_index, _, residual = kseq_step(
            target, draft, candidates, alive, accept_uniforms[:, :, depth]
        )
        stopped_here = running & (accepted_index < 0)
        next_probs = torch.where(stopped_here.unsqueeze(-1), residual, next_probs)
        running = running & ~stopped_here
        emitted = candidates.gather(1, accepted_index.clamp(min=0).unsqueeze(1))  # (B, 1)
        alive = torch.where(running.unsqueeze(-1), alive & (candidates == emitted), alive)
        num_accepted = num_accepted + running.long()
    representative = alive.int().argmax(dim=-1)
    bonus = _rows(target_probs[:, :, k], representative)
    next_probs = torch.where(running.unsqueeze(-1), bonus, next_probs)
    return _emit(num_accepted, next_probs, sample_uniforms, representative)
