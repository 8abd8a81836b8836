"""One speculative step: draft k tokens (or K sequences), verify them in one target forward.

The step functions own the KV-cache bookkeeping: both caches hold exactly the tokens of the
sequence before the step, grow during it, and are cropped back to the kept prefix after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from osd.generation import GenerationStats
from osd.models import CausalLM, crop_cache
from osd.sampling import SamplingParams, logits_to_probs, sample_from_probs
from osd.verification import VerifyOutput, block_verify, spectr_verify, token_verify

__all__ = [
    "VERIFIERS",
    "target_only_step",
    "DecodeRequest",
    "StepOutput",
    "single_draft_step",
    "spectr_step",
    "top_m_distribution",
]

VERIFIERS = {"token": token_verify, "block": block_verify, "spectr": spectr_verify}


@dataclass
class DecodeRequest:
    """Validated arguments and per-request state of one generation."""

    prompt_ids: list[int]
    seed: int
    max_new_tokens: int
    params: SamplingParams
    method: str
    num_spec_tokens: int
    num_drafts: int
    adapter: str | None
    stop_token_ids: frozenset[int]
    draft_gen: torch.Generator
    verify_gen: torch.Generator
    log_top_m: int | None
    adaptive_threshold: float
    stop: list[str]
    seq: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    log_rows: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    draft_token_probs: list[torch.Tensor] = field(default_factory=list)
    num_drafted: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)


@dataclass
class StepOutput:
    """One verified step: tokens to emit and the target rows for the log."""

    token_ids: list[int]
    num_drafted: int
    num_accepted: int
    target_logits: torch.Tensor  # (num_accepted + 1, V) rows of the emitted positions
    draft_token_probs: torch.Tensor  # (num_drafted,)


def top_m_distribution(logits: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target's top-m at temperature 1: (N, V) logits -> (N, m) ids and probs."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, m, dim=-1)
    return top.indices, top.values


def _uniforms(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device=gen.device, dtype=torch.float64)


def draft_tokens(
    draft: CausalLM,
    request: DecodeRequest,
    cache: DynamicCache,
    pending: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples up to k tokens per row from the draft; stops early on low confidence.

    Args:
        pending: (B, T) tokens not yet in the draft cache.

    Returns:
        ``(draft_ids, draft_probs)``: (B, k') and (B, k', V) with k' <= k.
    """
    ids: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    inputs = pending
    for i in range(k):
        logits = draft.logits(inputs, cache, num_logits=1, adapter=request.adapter)
        q = logits_to_probs(logits[:, 0], request.params)  # (B, V)
        x = sample_from_probs(q, _uniforms(request.draft_gen, q.shape[0]))  # (B,)
        ids.append(x)
        probs.append(q)
        inputs = x.unsqueeze(1)
        if request.adaptive_threshold > 0 and i < k - 1:
            confidence = q.gather(1, x.unsqueeze(1)).min()
            if float(confidence) < request.adaptive_threshold:
                break
    return torch.stack(ids, dim=1), torch.stack(probs, dim=1)


def single_draft_step(
    target: CausalLM,
    draft: CausalLM,
    request: DecodeRequest,
    target_cache: DynamicCache,
    draft_cache: DynamicCache,
    k: int,
) -> StepOutput:
    """Drafts one sequence, verifies it with token or block verification, crops the caches."""
    seq, device = request.seq, target.device
    length = len(seq)
    pending = torch.tensor([seq[draft_cache.get_seq_length() :]], device=device)
    draft_ids, draft_probs = draft_tokens(draft, request, draft_cache, pending, k)
    k = draft_ids.shape[1]
    target_input = torch.cat(
        [torch.tensor([seq[target_cache.get_seq_length() :]], device=device), draft_ids], dim=1
    )
    target_logits = target.logits(target_input, target_cache, num_logits=k + 1)
    target_probs = logits_to_probs(target_logits, request.params)  # (1, k + 1, V)
    verify = VERIFIERS["token" if request.method == "spectr" else request.method]
    result: VerifyOutput = verify(
        draft_ids,
        draft_probs,
        target_probs,
        _uniforms(request.verify_gen, 1, k),
        _uniforms(request.verify_gen, 1),
    )
    n = int(result.num_accepted[0])
    crop_cache(target_cache, length + n)
    crop_cache(draft_cache, length + n)
    return StepOutput(
        token_ids=[*draft_ids[0, :n].tolist(), int(result.next_token_ids[0])],
        num_drafted=k,
        num_accepted=n,
        target_logits=target_logits[0, : n + 1],
        draft_token_probs=draft_probs[0].gather(1, draft_ids[0].unsqueeze(1)).squeeze(1),
    )


def spectr_step(
    target: CausalLM,
    draft: CausalLM,
    request: DecodeRequest,
    target_cache: DynamicCache,
    draft_cache: DynamicCache,
    k: int,
) -> StepOutput:
    """Drafts K sequences, verifies the tree with K-SEQ, keeps the chosen row of each cache.

    The caches are replicated K-fold for the step and cut back to the chosen row afterwards.
    """
    seq, device, num_drafts = request.seq, target.device, request.num_drafts
    length = len(seq)
    pending = torch.tensor([seq[draft_cache.get_seq_length() :]], device=device)
    # The first draft position is shared: one forward, then K independent samples from it.
    logits = draft.logits(pending, draft_cache, num_logits=1, adapter=request.adapter)
    q_first = logits_to_probs(logits[:, 0], request.params).expand(num_drafts, -1)  # (K, V)
    x_first = sample_from_probs(q_first, _uniforms(request.draft_gen, num_drafts))  # (K,)
    draft_cache.batch_repeat_interleave(num_drafts)
    if k > 1:
        rest_ids, rest_probs = draft_tokens(
            draft, request, draft_cache, x_first.unsqueeze(1), k - 1
        )
        draft_ids = torch.cat([x_first.unsqueeze(1), rest_ids], dim=1)  # (K, k)
        draft_probs = torch.cat([q_first.unsqueeze(1), rest_probs], dim=1)  # (K, k, V)
    else:
        draft_ids, draft_probs = x_first.unsqueeze(1), q_first.unsqueeze(1)
    k = draft_ids.shape[1]
    shared = torch.tensor([seq[target_cache.get_seq_length() :]], device=device)
    target_cache.batch_repeat_interleave(num_drafts)
    target_input = torch.cat([shared.expand(num_drafts, -1), draft_ids], dim=1)
    target_logits = target.logits(target_input, target_cache, num_logits=k + 1)
    target_probs = logits_to_probs(target_logits, request.params)  # (K, k + 1, V)
    result = VERIFIERS["spectr"](
        draft_ids[None],
        draft_probs[None],
        target_probs[None],
        _uniforms(request.verify_gen, 1, num_drafts, k),
        _uniforms(request.verify_gen, 1),
    )
    n, row = int(result.num_accepted[0]), int(result.draft_index[0])
    keep = torch.tensor([row], device=device)
    for cache in (target_cache, draft_cache):
        cache.batch_select_indices(keep)
        crop_cache(cache, length + n)
    chosen_ids = draft_ids[row]
    return StepOutput(
        token_ids=[*chosen_ids[:n].tolist(), int(result.next_token_ids[0])],
        num_drafted=k,
        num_accepted=n,
        target_logits=target_logits[row, : n + 1],
        draft_token_probs=draft_probs[row].gather(1, chosen_ids.unsqueeze(1)).squeeze(1),
    )


def target_only_step(
    target: CausalLM,
    draft: CausalLM,
    request: DecodeRequest,
    target_cache: DynamicCache,
    draft_cache: DynamicCache,
    k: int,
) -> StepOutput:
    """Speculation off (method ``none``): one token sampled from the target, no draft."""
    seq, device = request.seq, target.device
    pending = torch.tensor([seq[target_cache.get_seq_length() :]], device=device)
    logits = target.logits(pending, target_cache, num_logits=1)  # (1, 1, V)
    probs = logits_to_probs(logits[:, 0], request.params)  # (1, V)
    token = sample_from_probs(probs, _uniforms(request.verify_gen, 1))
    return StepOutput(
        token_ids=[int(token[0])],
        num_drafted=0,
        num_accepted=0,
        target_logits=logits[0],
        draft_token_probs=probs.new_zeros(0),
    )
