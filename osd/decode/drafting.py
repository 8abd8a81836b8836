"""The draft's half of a step: k tokens per row (K sequences for SpecTr rows) in batched
forwards, each position's q from the same processing as the target's p (osd.decode.sampling).

The draft's cache is filled lazily: a row's prompt, and the tokens of steps in which it drafted
nothing (the controller's k = 0, or a model-free proposer's draft), are read by the draft only
when it next drafts for the row, in that step's first forward. A row far behind is caught up in
a forward of its own first, so the other rows' first forward is not padded to its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from osd.decode import rng
from osd.decode.forward import ModelPair, as_tensor, history_rows, left_padded, run_model
from osd.decode.grammar_masks import GrammarMasks
from osd.decode.prefix_history import History, extend_history
from osd.decode.rows import Row
from osd.decode.sampling import RowSampling, rows_to_probs, sample_from_probs
from osd.devices import to_device

__all__ = ["CATCH_UP_TOKENS", "Drafts", "propose"]

# A drafting row with more unread tokens than this, beside rows with fewer, is caught up in a
# forward of its own (a prompt, typically), not padded into everyone's first draft forward.
CATCH_UP_TOKENS = 8


@dataclass
class Drafts:
    """What the draft proposed for every row (zeros where a row drafted less)."""

    ids: torch.Tensor  # (B, K, k) drafted tokens per branch
    probs: torch.Tensor  # (B, K, k, V) q of each drafted position
    num_drafted: torch.Tensor  # (B,) tokens drafted per row (<= its k: the adaptive stop)


def propose(
    pair: ModelPair,
    rows: list[Row],
    sampling: RowSampling,
    history: History | None,
    spec_k: list[int],
    branches: list[int],
    width: int,
    masks: GrammarMasks | None = None,
) -> Drafts:
    """Drafts k tokens per row (K sequences for SpecTr rows) in batched draft forwards; with
    ``masks``, each position of a row with a grammar is masked after the tokens before it
    (the masks are filled as the tokens are drafted)."""
    device, num_rows, num_drafts = pair.device, len(rows), max(branches)
    # q keeps the precision it was computed in (float64 models: float64), as the verifiers
    # must see exactly the distribution each token was sampled from.
    q_dtype = torch.float64 if pair.dtype == torch.float64 else torch.float32
    ids = torch.zeros(num_rows, num_drafts, width, dtype=torch.int64, device=device)
    probs = torch.zeros(num_rows, num_drafts, width, pair.vocab_size, device=device, dtype=q_dtype)
    own_k = as_tensor(spec_k, device)
    drafting = [b for b in range(num_rows) if spec_k[b] > 0]
    if not drafting:
        return Drafts(ids, probs, own_k)
    draws = to_device(  # (B, K, k), drawn on the host (rng.step_draws)
        torch.from_numpy(
            rng.step_draws([r.draft_key for r in rows], [r.step for r in rows], num_drafts, width)
        ),
        device,
    )
    adaptive = any(row.request.adaptive_threshold > 0 for row in rows)
    if adaptive:
        thresholds = torch.tensor([row.request.adaptive_threshold for row in rows], device=device)
        counts = as_tensor(branches, device)
        real_branch = torch.arange(num_drafts, device=device) < counts.unsqueeze(1)  # (B, K)

    # Position 0: one forward over each row's pending tokens, shared by its branches.
    members = [rows[b] for b in drafting]
    behind = [row for row in members if len(row.seq) - row.draft_len > CATCH_UP_TOKENS]
    if behind and len(behind) < len(members):
        _catch_up(pair, behind)
    index = as_tensor(drafting, device)
    logits = _read_unread(pair, members, [len(row.seq) for row in members])
    allowed = None if masks is None else masks.draft_allowed(drafting, [0] * len(drafting), 0)
    q = rows_to_probs(
        logits[:, 0], sampling.select(index), history_rows(history, index), allowed
    ).unsqueeze(1)  # (D, 1, V)
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
        row_of = as_tensor([b for b, _ in active], device)
        branch_of = as_tensor([j for _, j in active], device)
        owners = [rows[b] for b, _ in active]
        if masks is not None:  # position i - 1's tokens to the host while this forward runs
            masks.prefetch(i, ids)
        logits = run_model(
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
            adapters=[row.draft_adapter for row in owners],
        )
        seen = history_rows(history, row_of)  # and the branch's drafts before position i
        seen = None if seen is None else extend_history(seen, ids[row_of, branch_of, :i])
        if masks is not None:
            masks.advance(i, ids)
            allowed = masks.draft_allowed([b for b, _ in active], [j for _, j in active], i)
        q = rows_to_probs(logits[:, 0], sampling.select(row_of), seen, allowed)  # (A, V)
        ids[row_of, branch_of, i] = sample_from_probs(q, draws[row_of, branch_of, i])
        probs[row_of, branch_of, i] = q
        if adaptive:
            own_k = _adaptive_stop(own_k, probs, ids, thresholds, real_branch, i)
    return Drafts(ids, probs, own_k)


def _catch_up(pair: ModelPair, rows: list[Row]) -> None:
    """Reads every token but the last of each row into the draft's cache, in one forward."""
    _read_unread(pair, rows, [len(row.seq) - 1 for row in rows])
    for row in rows:
        row.draft_len = len(row.seq) - 1


def _read_unread(pair: ModelPair, rows: list[Row], ends: list[int]) -> torch.Tensor:
    """One draft forward over each row's tokens from ``draft_len`` to its ``ends`` entry, into
    its first slot, with its adapter: (len(rows), 1, V) logits after each row's last one."""
    tokens = [row.seq[row.draft_len : end] for row, end in zip(rows, ends, strict=True)]
    input_ids, left, num_real = left_padded(tokens, pair.device)
    return run_model(
        pair,
        pair.draft,
        pair.draft_cache,
        input_ids,
        start=[row.draft_len for row in rows],
        left=left,
        num_real=num_real,
        own=[row.slots[0] for row in rows],
        base=[row.slots[0] for row in rows],
        prefix=[0] * len(rows),
        num_logits=1,
        adapters=[row.draft_adapter for row in rows],
    )


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
