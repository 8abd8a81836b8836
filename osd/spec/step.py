"""One batched speculative step over every active row, and the chunked prefill that precedes it.

A step, for all rows together: the draft's forwards (the first over each row's pending tokens,
then one per drafted position, every row with its own LoRA adapter in the same forward; SpecTr
rows fan out into K branch rows after the first), one target forward verifying every row's
pending and drafted tokens (ragged: rows differ in pending length, k and K), the verifiers
over each verifier's rows at once, then one host sync that brings back what each row emitted.
Random draws are addressed by (row seed, row step, branch, position) (:mod:`osd.spec.rng`), so a
row's output does not depend on what shares its batch. Paper references in
:mod:`osd.verification`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from osd.devices import to_device
from osd.generation import StreamChunk
from osd.models import CausalLM
from osd.sampling import (
    History,
    RowSampling,
    block_history,
    extend_history,
    rows_to_probs,
    sample_from_probs,
)
from osd.spec import rng
from osd.spec.goodput import GoodputController
from osd.spec.history import TokenHistory
from osd.spec.kv_cache import SlotKVCache, plan_forward
from osd.spec.rows import Row
from osd.verification import VerifyOutput, block_verify, spectr_verify, token_verify

__all__ = ["VERIFIERS", "ModelPair", "prefill", "run_step", "top_m_distribution"]

VERIFIERS: dict[str, Callable[..., VerifyOutput]] = {
    "token": token_verify,
    "block": block_verify,
    "spectr": spectr_verify,
}

# Counter position of the recovered/bonus token's draw (drafted positions use 0..k-1).
_SAMPLE_POSITION = 1023


@dataclass
class ModelPair:
    """The target and draft with their slot caches."""

    target: CausalLM
    draft: CausalLM
    target_cache: SlotKVCache
    draft_cache: SlotKVCache
    vocab_size: int
    log_top_m: int
    controller: GoodputController | None = None  # chooses k for rows that ask for "auto"
    history: TokenHistory = field(init=False)  # token counts of rows with a penalty

    def __post_init__(self) -> None:
        self.history = TokenHistory(self.target_cache.num_slots, self.vocab_size, self.device)

    def sampling(self, rows: list[Row]) -> tuple[RowSampling, History | None]:
        """The rows' sampling parameters, and their histories when a penalty needs them."""
        sampling = RowSampling.of([r.request.params for r in rows], self.device, self.vocab_size)
        return sampling, self.history.of(rows) if sampling.any_history else None

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.model.parameters()).dtype


def top_m_distribution(logits: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target's top-m at temperature 1: (..., V) logits -> (..., m) ids and probs."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, m, dim=-1)
    return top.indices, top.values


def _tensor(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def _left_padded(
    token_lists: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Rows of tokens, left-padded to one width: (B, T) ids, each row's padding and length."""
    width = max(len(tokens) for tokens in token_lists)
    lengths = [len(tokens) for tokens in token_lists]
    rows = [[0] * (width - len(tokens)) + tokens for tokens in token_lists]
    return _tensor(rows, device), [width - n for n in lengths], lengths


def _run(
    pair: ModelPair,
    model: CausalLM,
    cache: SlotKVCache,
    input_ids: torch.Tensor,
    *,
    start: list[int],
    left: list[int],
    num_real: list[int],
    own: list[int],
    base: list[int],
    prefix: list[int],
    num_logits: int,
    adapters: list[str | None] | None = None,
) -> torch.Tensor:
    """One forward of ``model`` over rows laid out as ``left`` padding, ``num_real`` tokens
    written from position ``start`` to slot ``own`` (reading ``prefix`` positions from ``base``),
    then right padding."""
    device = input_ids.device
    # One host-to-device copy for the six per-row columns of the plan.
    columns = _tensor([start, left, num_real, own, base, prefix], device)
    plan = plan_forward(
        input_ids=input_ids,
        start=columns[0],
        left=columns[1],
        real=columns[2],
        own_slot=columns[3],
        base_slot=columns[4],
        prefix_len=columns[5],
        trash_slot=cache.trash_slot,
        dtype=pair.dtype,
        kv_len=max(s + n for s, n in zip(start, num_real, strict=True)),
    )
    return model.run(plan, cache, num_logits=num_logits, adapters=adapters)


@torch.inference_mode()
def prefill(pair: ModelPair, rows: list[Row], budget: int) -> list[StreamChunk]:
    """Runs up to ``budget`` prompt tokens of ``rows`` through both models (chunked prefill).

    A row whose prompt is now complete gets its first token sampled from the target's
    distribution after the prompt (exactly the target alone's first token: no draft is needed
    for it), so its first chunk comes with its prefill.

    Returns:
        The first chunk of each row that completed its prompt, in order.
    """
    pieces: list[tuple[Row, int]] = []
    for row in rows:
        size = min(row.prefill_left, budget)
        if size > 0:
            pieces.append((row, size))
            budget -= size
    if not pieces:
        return []
    target_logits = None
    for model, cache, members in (
        (pair.target, pair.target_cache, pieces),
        (pair.draft, pair.draft_cache, [p for p in pieces if p[0].request.method != "none"]),
    ):
        if not members:
            continue
        tokens = [row.seq[row.target_len : row.target_len + size] for row, size in members]
        ids, left, num_real = _left_padded(tokens, pair.device)
        logits = _run(
            pair,
            model,
            cache,
            ids,
            start=[row.target_len for row, _ in members],
            left=left,
            num_real=num_real,
            own=[row.slots[0] for row, _ in members],
            base=[row.slots[0] for row, _ in members],
            prefix=[0] * len(members),
            num_logits=1,
            adapters=[row.request.adapter for row, _ in members] if model is pair.draft else None,
        )
        if model is pair.target:
            target_logits = logits[:, 0]  # (P, V) after each piece's last token
    for row, size in pieces:
        row.target_len += size
        if row.request.method != "none":
            row.draft_len = row.target_len
    assert target_logits is not None
    complete = [i for i, (row, _) in enumerate(pieces) if row.prefill_left == 0]
    if not complete:
        return []
    return _first_tokens(pair, [pieces[i][0] for i in complete], target_logits[complete])


def _first_tokens(pair: ModelPair, rows: list[Row], logits: torch.Tensor) -> list[StreamChunk]:
    """Samples each row's first token from the target (a step with nothing drafted)."""
    device = logits.device
    probs = rows_to_probs(logits, *pair.sampling(rows))
    keys = _tensor([row.verify_key for row in rows], device)
    steps = _tensor([row.step for row in rows], device)
    tokens = sample_from_probs(probs, rng.uniforms(keys, rng.counter(steps, 0, _SAMPLE_POSITION)))
    if any(row.request.log_top_m for row in rows):
        top_ids, top_probs = top_m_distribution(logits.unsqueeze(1), pair.log_top_m)  # (P, 1, m)
    chunks = []
    for i, (row, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
        if row.request.log_top_m:
            row.log_rows.append((top_ids[i], top_probs[i]))
        chunks.append(row.emit([], 0, token, 0))
    return chunks


@dataclass
class _Drafts:
    """What the draft proposed for every row (zeros where a row drafted less)."""

    ids: torch.Tensor  # (B, K, k) drafted tokens per branch
    probs: torch.Tensor  # (B, K, k, V) q of each drafted position
    num_drafted: torch.Tensor  # (B,) tokens drafted per row (<= its k: the adaptive stop)


def _rows_of(history: History | None, index: torch.Tensor) -> History | None:
    return None if history is None else History(history.counts[index], history.seen[index])


def _propose(
    pair: ModelPair,
    rows: list[Row],
    sampling: RowSampling,
    history: History | None,
    spec_k: list[int],
    branches: list[int],
    width: int,
) -> _Drafts:
    """Drafts k tokens per row (K sequences for SpecTr rows) in batched draft forwards."""
    device, num_rows, num_drafts = pair.device, len(rows), max(branches)
    # q keeps the precision it was computed in (float64 models: float64), as the verifiers
    # must see exactly the distribution each token was sampled from.
    q_dtype = torch.float64 if pair.dtype == torch.float64 else torch.float32
    ids = torch.zeros(num_rows, num_drafts, width, dtype=torch.int64, device=device)
    probs = torch.zeros(num_rows, num_drafts, width, pair.vocab_size, device=device, dtype=q_dtype)
    own_k = _tensor(spec_k, device)
    drafting = [b for b in range(num_rows) if spec_k[b] > 0]
    if not drafting:
        return _Drafts(ids, probs, own_k)
    keys = _tensor([row.draft_key for row in rows], device)
    steps = _tensor([row.step for row in rows], device)
    draws = rng.step_uniforms(keys, steps, num_drafts, width)  # (B, K, k)
    adaptive = any(row.request.adaptive_threshold > 0 for row in rows)
    if adaptive:
        thresholds = torch.tensor([row.request.adaptive_threshold for row in rows], device=device)
        counts = _tensor(branches, device)
        real_branch = torch.arange(num_drafts, device=device) < counts.unsqueeze(1)  # (B, K)

    # Position 0: one forward over each row's pending tokens, shared by its branches.
    members = [rows[b] for b in drafting]
    index = _tensor(drafting, device)
    input_ids, left, num_real = _left_padded([row.seq[row.draft_len :] for row in members], device)
    logits = _run(
        pair,
        pair.draft,
        pair.draft_cache,
        input_ids,
        start=[row.draft_len for row in members],
        left=left,
        num_real=num_real,
        own=[row.slots[0] for row in members],
        base=[row.slots[0] for row in members],
        prefix=[0] * len(members),
        num_logits=1,
        adapters=[row.request.adapter for row in members],
    )
    q = rows_to_probs(logits[:, 0], sampling.select(index), _rows_of(history, index))
    q = q.unsqueeze(1)  # (D, 1, V)
    ids[index, :, 0] = sample_from_probs(q.expand(-1, num_drafts, -1), draws[index, :, 0])
    probs[index, :, 0] = q
    if adaptive:
        own_k = _adaptive_stop(own_k, probs, ids, thresholds, real_branch, 0)

    # Positions 1..k-1: every branch of every row still drafting, one token each.
    fan_out = [(b, j) for b in drafting for j in range(branches[b])]
    for i in range(1, width):
        active = [(b, j) for b, j in fan_out if spec_k[b] > i]
        if not active:
            break
        row_of = _tensor([b for b, _ in active], device)
        branch_of = _tensor([j for _, j in active], device)
        owners = [rows[b] for b, _ in active]
        logits = _run(
            pair,
            pair.draft,
            pair.draft_cache,
            ids[row_of, branch_of, i - 1].unsqueeze(1),
            start=[len(row.seq) + i - 1 for row in owners],
            left=[0] * len(active),
            num_real=[1] * len(active),
            own=[row.slots[j] for row, (_, j) in zip(owners, active, strict=True)],
            base=[row.slots[0] for row in owners],
            prefix=[len(row.seq) for row in owners],
            num_logits=1,
            adapters=[row.request.adapter for row in owners],
        )
        seen = _rows_of(history, row_of)  # and the branch's drafts before position i
        seen = None if seen is None else extend_history(seen, ids[row_of, branch_of, :i])
        q = rows_to_probs(logits[:, 0], sampling.select(row_of), seen)  # (A, V)
        ids[row_of, branch_of, i] = sample_from_probs(q, draws[row_of, branch_of, i])
        probs[row_of, branch_of, i] = q
        if adaptive:
            own_k = _adaptive_stop(own_k, probs, ids, thresholds, real_branch, i)
    return _Drafts(ids, probs, own_k)


def _adaptive_stop(
    own_k: torch.Tensor,
    probs: torch.Tensor,
    ids: torch.Tensor,
    thresholds: torch.Tensor,
    real_branch: torch.Tensor,
    position: int,
) -> torch.Tensor:
    """Stops a row's drafting after ``position`` when a drafted token's q is below its
    threshold (depends on the draft only, so outputs stay exact). Rows that draft fewer
    positions (or none) are unaffected: their ``own_k`` is at most ``position + 1`` already."""
    confidence = probs[:, :, position].gather(-1, ids[:, :, position].unsqueeze(-1))[..., 0]
    lowest = confidence.masked_fill(~real_branch, float("inf")).amin(dim=-1)  # (B,)
    low = lowest < thresholds
    return torch.where(low & (own_k > position + 1), position + 1, own_k)


@dataclass
class _Verified:
    num_accepted: torch.Tensor  # (B,)
    next_token_ids: torch.Tensor  # (B,)
    draft_index: torch.Tensor  # (B,) the branch whose prefix was kept


def _verify(
    rows: list[Row],
    drafts: _Drafts,
    target_probs: torch.Tensor,
    first_row: torch.Tensor,
    branches: list[int],
    width: int,
) -> _Verified:
    """Runs each verifier once over its rows; draws come from each row's verify stream."""
    device, num_rows = target_probs.device, len(rows)
    keys = _tensor([row.verify_key for row in rows], device)
    steps = _tensor([row.step for row in rows], device)
    sample_draws = rng.uniforms(keys, rng.counter(steps, 0, _SAMPLE_POSITION))  # (B,)
    zeros = torch.zeros(num_rows, dtype=torch.int64, device=device)
    if width == 0:  # speculation off for every row: sample from the target
        next_ids = sample_from_probs(target_probs[first_row, 0], sample_draws)
        return _Verified(zeros, next_ids, zeros.clone())
    num_drafts = drafts.ids.shape[1]
    accept_draws = rng.step_uniforms(keys, steps, num_drafts, width)  # (B, K, k)
    result = _Verified(zeros.clone(), zeros.clone(), zeros.clone())
    for name, verify in VERIFIERS.items():
        members = [b for b, row in enumerate(rows) if row.request.verifier == name]
        if not members:
            continue
        group = _tensor(members, device)
        if name == "spectr":
            counts = _tensor([branches[b] for b in members], device)
            branch = torch.minimum(torch.arange(num_drafts, device=device), counts.unsqueeze(1) - 1)
            out = verify(
                drafts.ids[group],
                drafts.probs[group],
                target_probs[first_row[group].unsqueeze(1) + branch],  # (G, K, k + 1, V)
                accept_draws[group],
                sample_draws[group],
                num_draft_tokens=drafts.num_drafted[group],
                num_drafts=counts,
            )
        else:
            out = verify(
                drafts.ids[group, 0],
                drafts.probs[group, 0],
                target_probs[first_row[group]],
                accept_draws[group, 0],
                sample_draws[group],
                num_draft_tokens=drafts.num_drafted[group],
            )
        result.num_accepted[group] = out.num_accepted
        result.next_token_ids[group] = out.next_token_ids
        result.draft_index[group] = out.draft_index
    return result


@torch.inference_mode()
def run_step(pair: ModelPair, rows: list[Row]) -> list[StreamChunk]:
    """One speculative step for every row (all prefilled); returns each row's chunk."""
    started = time.perf_counter()
    device, num_rows = pair.device, len(rows)
    spec_k = [row.spec_tokens(pair.controller, num_rows) for row in rows]
    branches = [row.request.num_slots for row in rows]
    width = max(spec_k)
    sampling, history = pair.sampling(rows)
    drafts = _propose(pair, rows, sampling, history, spec_k, branches, max(width, 1))

    # One target forward: each branch row holds its pending tokens, then its drafts.
    fan_out = [(b, j) for b in range(num_rows) for j in range(branches[b])]
    first_row = _tensor([sum(branches[:b]) for b in range(num_rows)], device)
    row_of = _tensor([b for b, _ in fan_out], device)
    pending, left, num_real = _left_padded(
        [rows[b].seq[rows[b].target_len :] for b, _ in fan_out], device
    )
    input_ids = pending
    spec = torch.zeros(len(fan_out), 0, dtype=torch.int64, device=device)
    if width > 0:  # drafts after the pending tokens; rows that drafted less are right-padded
        spec = drafts.ids[row_of, _tensor([j for _, j in fan_out], device), :width]  # (R, k)
        k_of = _tensor([spec_k[b] for b, _ in fan_out], device)
        spec = spec.masked_fill(torch.arange(width, device=device) >= k_of.unsqueeze(1), 0)
        input_ids = torch.cat([pending, spec], dim=1)
        num_real = [n + spec_k[b] for n, (b, _) in zip(num_real, fan_out, strict=True)]
    logits = _run(
        pair,
        pair.target,
        pair.target_cache,
        input_ids,
        start=[rows[b].target_len for b, _ in fan_out],
        left=left,
        num_real=num_real,
        own=[rows[b].slots[j] for b, j in fan_out],
        base=[rows[b].slots[0] for b, _ in fan_out],
        prefix=[rows[b].target_len for b, _ in fan_out],
        num_logits=width + 1,
    )  # (R, k + 1, V)
    # Position i of a branch row sees that branch's drafts before it (its padding only past
    # its own k, where nothing is read).
    seen = _rows_of(history, row_of)
    target_probs = rows_to_probs(
        logits, sampling.select(row_of), None if seen is None else block_history(seen, spec)
    )
    verified = _verify(rows, drafts, target_probs, first_row, branches, width)

    everyone = torch.arange(num_rows, device=device)
    chosen_ids = drafts.ids[everyone, verified.draft_index, :width]  # (B, k)
    if any(row.request.log_top_m for row in rows):
        top_ids, top_probs = top_m_distribution(
            logits[first_row + verified.draft_index], pair.log_top_m
        )  # (B, k + 1, m)
        chosen_q = drafts.probs[everyone, verified.draft_index, :width]  # (B, k, V)
        draft_token_probs = chosen_q.gather(-1, chosen_ids.unsqueeze(-1))[..., 0]  # (B, k)
    # The one host sync of the step.
    packed = torch.cat(
        [
            torch.stack(
                [
                    verified.num_accepted,
                    verified.next_token_ids,
                    verified.draft_index,
                    drafts.num_drafted,
                ],
                dim=1,
            ),
            chosen_ids,
        ],
        dim=1,
    ).tolist()
    copies: dict[str, list[tuple[int, int, int]]] = {"target": [], "draft": []}
    chunks = []
    for b, row in enumerate(rows):
        num_accepted, next_token, branch, num_drafted = packed[b][:4]
        length = len(row.seq)
        # The draft cache holds the pending tokens and the drafts fed back (all but the last).
        draft_len = min(length + spec_k[b] - 1, length + num_accepted)
        if branch > 0:  # a SpecTr branch won: its kept tokens move to the request's slot
            src, dst = row.slots[branch], row.slots[0]
            copies["target"] += [
                (src, dst, p) for p in range(row.target_len, length + num_accepted)
            ]
            copies["draft"] += [(src, dst, p) for p in range(length, draft_len)]
        row.target_len = length + num_accepted
        if spec_k[b] > 0:
            row.draft_len = draft_len
        if row.request.log_top_m:
            row.log_rows.append((top_ids[b, : num_accepted + 1], top_probs[b, : num_accepted + 1]))
            row.draft_token_probs.append(draft_token_probs[b, :num_drafted])
        if pair.controller is not None:
            pair.controller.observe_row(row.stats_key, row.request.route, num_drafted, num_accepted)
        chunks.append(row.emit(packed[b][4:], num_accepted, next_token, num_drafted))
    for name, cache in (("target", pair.target_cache), ("draft", pair.draft_cache)):
        if copies[name]:
            moves = _tensor(copies[name], device)  # (N, 3): src, dst, position
            cache.copy_positions(moves[:, 0], moves[:, 1], moves[:, 2])
    if pair.controller is not None:  # after the step's sync: host time is the step's time
        pair.controller.observe_step(num_rows, width, time.perf_counter() - started)
    return chunks
