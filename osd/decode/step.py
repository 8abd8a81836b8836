"""One batched speculative step over every active row, and the chunked prefill that precedes it.

A step, for all rows together: the draft's forwards (the first over each row's pending tokens,
then one per drafted position, every row with its own LoRA adapter in the same forward; SpecTr
rows fan out into K branch rows after the first), one target forward verifying every row's
pending and drafted tokens (ragged: rows differ in pending length, k and K), the verifiers
over each verifier's rows at once, then one host sync that brings back what each row emitted.
Random draws are addressed by (row seed, row step, branch, position) (:mod:`osd.decode.rng`), so a
row's output does not depend on what shares its batch. Paper references in
:mod:`osd.decode.verification`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from osd.decode import rng
from osd.decode.choices import share_prompt
from osd.decode.drafting import CATCH_UP_TOKENS, Drafts, propose
from osd.decode.forward import (
    ModelPair,
    as_tensor,
    computed_positions,
    history_rows,
    left_padded,
    run_model,
)
from osd.decode.generation import StreamChunk
from osd.decode.grammar_masks import GrammarMasks
from osd.decode.log_top_m import LoggedPositions
from osd.decode.logprobs import PendingLogprobs, gather_logprobs
from osd.decode.prefix_history import block_history
from osd.decode.prompt_logprobs import prefill_target
from osd.decode.rows import Row
from osd.decode.sampling import rows_to_greedy_ids, rows_to_probs, sample_from_probs
from osd.decode.verification import VerifyOutput, block_verify, spectr_verify, token_verify
from osd.devices import on_host, to_device

__all__ = ["VERIFIERS", "prefill", "run_step"]

VERIFIERS: dict[str, Callable[..., VerifyOutput]] = {
    "token": token_verify,
    "block": block_verify,
    "spectr": spectr_verify,
}

# Counter position of the recovered/bonus token's draw (drafted positions use 0..k-1).
_SAMPLE_POSITION = 1023


@torch.inference_mode()
def prefill(pair: ModelPair, rows: list[Row], budget: int) -> list[StreamChunk]:
    """Runs up to ``budget`` prompt tokens of ``rows`` through the target (chunked prefill).

    The draft model reads a prompt only when it first drafts for the row
    (:func:`osd.decode.drafting.propose` catches its cache up): a row that the controller, a
    model-free proposer or ``method: none`` keeps off the draft model never pays for it, so
    speculation that does not help costs what the target alone costs.

    A row whose prompt is now complete gets its first token sampled from the target's
    distribution after the prompt (exactly the target alone's first token: no draft is needed
    for it), so its first chunk comes with its prefill. Its ``followers`` (other choices of
    the prompt) get its KV and sample their first tokens from the same logits.

    Returns:
        The first chunk of each row that completed its prompt, in order, then its followers'.
    """
    pieces: list[tuple[Row, int]] = []
    for row in rows:
        size = min(row.prefill_left, budget)
        if size > 0:
            pieces.append((row, size))
            budget -= size
    if not pieces:
        return []
    # (P, V) after each piece's last token; rows asking for prompt logprobs get them too.
    target_logits = prefill_target(pieces, lambda some, n: _prefill_forward(pair, some, n))
    for row, size in pieces:
        row.target_len += size
    complete = [i for i, (row, _) in enumerate(pieces) if row.prefill_left == 0]
    if not complete:
        return []
    # Other choices of a completed prompt get its KV and logits (osd.decode.choices).
    done, logits = share_prompt(pair, [pieces[i][0] for i in complete], target_logits[complete])
    return _first_tokens(pair, done, logits)


def _prefill_forward(
    pair: ModelPair, members: list[tuple[Row, int]], num_logits: int
) -> torch.Tensor:
    """The target's forward over prefill pieces: (len(members), num_logits, V) last logits."""
    tokens = [row.seq[row.target_len : row.target_len + size] for row, size in members]
    ids, left, num_real = left_padded(tokens, pair.device)
    return run_model(
        pair,
        pair.target,
        pair.target_cache,
        ids,
        start=[row.target_len for row, _ in members],
        left=left,
        num_real=num_real,
        own=[row.slots[0] for row, _ in members],
        base=[row.slots[0] for row, _ in members],
        prefix=[0] * len(members),
        num_logits=num_logits,
    )


def _first_tokens(pair: ModelPair, rows: list[Row], logits: torch.Tensor) -> list[StreamChunk]:
    """Samples each row's first token from the target (a step with nothing drafted)."""
    device = logits.device
    masks = None
    if GrammarMasks.needed(rows):
        masks = GrammarMasks(rows, [0] * len(rows), [1] * len(rows), 0, pair.vocab_size, device)
    allowed = None if masks is None else masks.target_allowed(1)[:, 0]
    probs = rows_to_probs(logits, *pair.sampling(rows), allowed)
    tokens = sample_from_probs(probs, _verify_draws(rows, device)[0])
    if any(row.request.log_top_m for row in rows):  # read after the sync below (on_host)
        top = pair.log_distribution.now(logits.unsqueeze(1))
    zeros = torch.zeros(len(rows), dtype=torch.int64, device=device)
    on_way = _start_logprobs(  # no drafts: the first token is position 0
        rows,
        logits.unsqueeze(1),
        torch.arange(len(rows), device=device),
        zeros[:, None][:, :0],
        zeros,
        tokens,
    )
    token_list = tokens.tolist()  # the host sync
    if masks is not None:
        masks.commit([[token] for token in token_list])
    logprobs = {} if on_way is None else on_way.rows()
    chunks = []
    for i, (row, token) in enumerate(zip(rows, token_list, strict=True)):
        if row.request.log_top_m:
            row.log_rows.append(LoggedPositions(top, i, 1))
        chunks.append(row.emit([], 0, token, 0, logprobs.get(i)))
    return chunks


def _start_logprobs(
    rows: list[Row],
    logits: torch.Tensor,
    logits_row: torch.Tensor,
    accepted_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    next_ids: torch.Tensor,
) -> PendingLogprobs | None:
    """Starts the logprobs of the rows that ask for them; None (and no work) when none does.

    Args:
        logits: (R, T, V) the target's logits; position i after a row's i-th emitted token.
        logits_row: (B,) each row's row of ``logits`` (its chosen branch).
        accepted_ids, num_accepted, next_ids: (B, T - 1), (B,), (B,) the step's tokens: the
            first ``num_accepted`` drafts, then the next token.
    """
    members = [b for b, row in enumerate(rows) if row.request.logprobs is not None]
    if not members:
        return None
    emitted = torch.cat([accepted_ids, next_ids.unsqueeze(1)], dim=1)  # (B, T)
    emitted.scatter_(1, num_accepted.unsqueeze(1), next_ids.unsqueeze(1))
    num_top = [rows[b].request.logprobs or 0 for b in members]
    return gather_logprobs(logits, logits_row, emitted, members, num_top)


def _verify_draws(
    rows: list[Row], device: torch.device, num_drafts: int = 0, width: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's draws from its verify stream, drawn on the host and sent in one copy: (B,)
    for the token it samples from the target (the recovered or bonus token, or the first
    token after its prompt) and (B, num_drafts, width) for accepting its drafts."""
    keys, steps = [row.verify_key for row in rows], [row.step for row in rows]
    sample = rng.host_uniforms(
        np.asarray(keys, dtype=np.int64),
        rng.counter(np.asarray(steps, dtype=np.int64), 0, _SAMPLE_POSITION),
    )
    accept = rng.step_draws(keys, steps, num_drafts, width)
    draws = to_device(torch.from_numpy(np.concatenate([sample, accept.reshape(-1)])), device)
    return draws[: len(rows)], draws[len(rows) :].view(accept.shape)


@dataclass
class _Verified:
    num_accepted: torch.Tensor  # (B,)
    next_token_ids: torch.Tensor  # (B,)
    draft_index: torch.Tensor  # (B,) the branch whose prefix was kept


def _verify(
    rows: list[Row],
    drafts: Drafts,
    target_probs: torch.Tensor,
    first_row: torch.Tensor,
    branches: list[int],
    width: int,
) -> _Verified:
    """Runs each verifier once over its rows; draws come from each row's verify stream."""
    device, num_rows = target_probs.device, len(rows)
    num_drafts = drafts.ids.shape[1]
    sample_draws, accept_draws = _verify_draws(rows, device, num_drafts, width)  # (B, K, k)
    zeros = torch.zeros(num_rows, dtype=torch.int64, device=device)
    if width == 0:  # speculation off for every row: sample from the target
        next_ids = sample_from_probs(target_probs[first_row, 0], sample_draws)
        return _Verified(zeros, next_ids, zeros.clone())
    result = _Verified(zeros.clone(), zeros.clone(), zeros.clone())
    num_branches = as_tensor(branches, device)  # (B,) K per row, 1 for one draft
    # (B, K) each draft's target row; drafts beyond a row's own K repeat its last (unread).
    draft = torch.arange(num_drafts, device=device)
    target_rows = first_row.unsqueeze(1) + torch.minimum(draft, num_branches.unsqueeze(1) - 1)
    for name, verify in VERIFIERS.items():
        members = [b for b, row in enumerate(rows) if row.request.verifier == name]
        if not members:
            continue
        group = as_tensor(members, device)
        # SpecTr verifies each row's K drafts, (G, K, ...); token and block its one, (G, ...).
        lane = slice(None) if name == "spectr" else 0
        out = verify(
            drafts.ids[group, lane],
            drafts.probs[group, lane],
            target_probs[target_rows[group, lane]],
            accept_draws[group, lane],
            sample_draws[group],
            num_draft_tokens=drafts.num_drafted[group],
            **({"num_drafts": num_branches[group]} if name == "spectr" else {}),
        )
        result.num_accepted[group] = out.num_accepted
        result.next_token_ids[group] = out.next_token_ids
        result.draft_index[group] = out.draft_index
    return result


def _verify_greedy(drafts: Drafts, target_ids: torch.Tensor, width: int) -> _Verified:
    """Greedy rows under token or block verification, one draft each: the drafted prefix the
    target's argmax agrees with, then the target's argmax at the first disagreement (or after
    the last draft). It is what both verifiers return when the target's distribution is one-hot
    (a drafted token is kept with probability p(x) / q(x) capped at 1, i.e. exactly when it is
    the argmax, and the residual and bonus distributions are the one-hot itself), computed
    without the (B, k + 1, V) distributions; ``target_ids``: (B, k + 1)."""
    zeros = torch.zeros(target_ids.shape[0], dtype=torch.int64, device=target_ids.device)
    if width == 0:
        return _Verified(zeros, target_ids[:, 0], zeros.clone())
    positions = torch.arange(width, device=target_ids.device)
    agree = (drafts.ids[:, 0, :width] == target_ids[:, :width]) & (
        positions < drafts.num_drafted.unsqueeze(1)
    )
    num_accepted = agree.long().cumprod(dim=1).sum(dim=1)
    next_ids = target_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return _Verified(num_accepted, next_ids, zeros.clone())


@torch.inference_mode()
def run_step(pair: ModelPair, rows: list[Row]) -> list[StreamChunk]:
    """One speculative step for every row (all prefilled); returns each row's chunk."""
    started = time.perf_counter()
    device, num_rows = pair.device, len(rows)
    # Who drafts what (osd.decode.proposers): the draft model's rows, and rows whose drafts
    # were looked up (grammar and SpecTr rows always take the model's).
    plan = pair.proposers.plan(rows, pair.controller, pair.target.packs)
    spec_k = plan.spec_k
    branches = [row.request.num_slots for row in rows]
    width = max(spec_k)
    sampling, history = pair.sampling(rows)
    masks = None
    if GrammarMasks.needed(rows):
        masks = GrammarMasks(rows, spec_k, branches, width, pair.vocab_size, device)
    # Rows back on the draft model after steps without it read what they missed first: the
    # step is dearer than its drafting, and the controller's cost line leaves it out. A prompt
    # riding in the step (osd.decode.loop) makes it dearer still, for no drafting's sake: the
    # controller leaves such a step out of its costs and its realized-gain guard alike.
    unread = [len(r.seq) - r.draft_len for r, k in zip(rows, plan.model_k, strict=True) if k]
    catching_up = bool(unread) and sum(unread) > CATCH_UP_TOKENS * len(unread)
    riding = any(row.prefill_left > 0 for row in rows)
    growths = pair.target_cache.growths + pair.draft_cache.growths
    # No row of the draft model: no draft forward this step.
    drafts = propose(pair, rows, sampling, history, plan.model_k, branches, width, masks)
    pair.proposers.fill(plan, drafts.ids, drafts.probs, drafts.num_drafted)
    if masks is not None:  # the drafts to the host while the target's forward runs
        masks.prefetch(width, drafts.ids)

    # One target forward: each branch row holds its pending tokens, then its drafts.
    fan_out = [(b, j) for b in range(num_rows) for j in range(branches[b])]
    first_row = as_tensor([sum(branches[:b]) for b in range(num_rows)], device)
    row_of = as_tensor([b for b, _ in fan_out], device)
    pending, left, num_real = left_padded(
        [rows[b].seq[rows[b].target_len :] for b, _ in fan_out], device
    )
    input_ids = pending
    spec = torch.zeros(len(fan_out), 0, dtype=torch.int64, device=device)
    if width > 0:  # drafts after the pending tokens; rows that drafted less are right-padded
        spec = drafts.ids[row_of, as_tensor([j for _, j in fan_out], device), :width]  # (R, k)
        k_of = as_tensor([spec_k[b] for b, _ in fan_out], device)
        spec = spec.masked_fill(torch.arange(width, device=device) >= k_of.unsqueeze(1), 0)
        input_ids = torch.cat([pending, spec], dim=1)
        num_real = [n + spec_k[b] for n, (b, _) in zip(num_real, fan_out, strict=True)]
    logits = run_model(
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
    if masks is not None:  # the bonus position's masks, after each row's last drafted token
        masks.advance(width, drafts.ids)
    # Position i of a branch row sees that branch's drafts before it (its padding only past
    # its own k, where nothing is read).
    seen = history_rows(history, row_of)
    processing = (
        sampling.select(row_of),
        None if seen is None else block_history(seen, spec),
        None if masks is None else masks.target_allowed(width + 1),
    )
    if sampling.all_greedy and all(row.request.verifier != "spectr" for row in rows):
        verified = _verify_greedy(drafts, rows_to_greedy_ids(logits, *processing), width)
    else:
        target_probs = rows_to_probs(logits, *processing)
        verified = _verify(rows, drafts, target_probs, first_row, branches, width)

    everyone = torch.arange(num_rows, device=device)
    chosen_ids = drafts.ids[everyone, verified.draft_index, :width]  # (B, k)
    logged = any(row.request.log_top_m for row in rows)
    if logged:
        # The rows' chosen branches' logits (the step's own tensor, which nothing writes
        # afterwards: the worker may read it later); without branches, the logits themselves.
        chosen = logits if len(fan_out) == num_rows else logits[first_row + verified.draft_index]
        top = pair.log_distribution.before_sync(chosen)
        positions = torch.arange(width, device=device)
        draft_q = drafts.probs[  # (B, k): each drafted token's q, no (B, k, V) copy
            everyone[:, None], verified.draft_index[:, None], positions[None, :], chosen_ids
        ]
        # Read after the step's sync; each row's share is a host slice, not a tensor op.
        (draft_token_probs,) = on_host(draft_q)
    on_way = _start_logprobs(
        rows,
        logits,
        first_row + verified.draft_index,
        chosen_ids,
        verified.num_accepted,
        verified.next_token_ids,
    )
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
    logprobs = {} if on_way is None else on_way.rows()
    if logged:  # on a CPU: each row's kept positions, computed beside this thread
        kept = [p[0] + 1 if r.request.log_top_m else 0 for p, r in zip(packed, rows, strict=True)]
        step_top = top if top is not None else pair.log_distribution.after_sync(chosen, kept)
    if masks is not None:
        masks.commit([row[4 : 4 + row[0]] + [row[1]] for row in packed])
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
        if plan.model_k[b] > 0:  # the draft's cache moved; looked-up rows catch it up later
            row.draft_len = draft_len
        if row.request.log_top_m:
            row.log_rows.append(LoggedPositions(step_top, b, num_accepted + 1))
            row.draft_token_probs.append(draft_token_probs[b, :num_drafted])
        looked_up = plan.lookups.get(b)
        if pair.controller is not None:
            if looked_up is None:
                pair.controller.observe_row(
                    row.stats_key, row.request.route, num_drafted, num_accepted
                )
            else:
                pair.controller.observe_free(
                    plan.names[b], row.request.route, sum(looked_up.probs), num_accepted
                )
        chunks.append(
            row.emit(
                packed[b][4:],
                num_accepted,
                next_token,
                num_drafted,
                logprobs.get(b),
                plan.names[b],
            )
        )
        if row.finish_reason is not None:  # what it said is there to be looked up next time
            pair.proposers.learn(row)
    for name, cache in (("target", pair.target_cache), ("draft", pair.draft_cache)):
        if copies[name]:
            moves = as_tensor(copies[name], device)  # (N, 3): src, dst, position
            cache.copy_positions(moves[:, 0], moves[:, 1], moves[:, 2])
    if pair.controller is not None:  # after the step's sync: host time is the step's time
        seconds = time.perf_counter() - started
        # A step of the draft model costs by its depth (the draft's forwards, one a drafted
        # position); a step without one by the positions each row verified beyond its own next
        # token (the width, or their mean where the forward computed only what rows have).
        if plan.model_runs:
            extra = float(max(plan.model_k))
        else:
            computed = computed_positions(pair.target, num_real, input_ids.shape[1])
            extra = max(computed / len(fan_out) - 1, 0.0)
        emitted = num_rows + sum(row[0] for row in packed)
        pair.controller.observe_step(
            num_rows,
            extra,
            seconds,
            plan.model_runs,
            catching_up,
            emitted,
            riding,
            explorable=plan.controlled / num_rows,
            grew=pair.target_cache.growths + pair.draft_cache.growths > growths,
        )
    return chunks
