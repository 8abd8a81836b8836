"""Several choices of one prompt (OpenAI's ``n``): derived seeds and one shared prefill.

A request for ``n`` choices becomes a *group* of ``n`` ordinary requests that differ only in
their seed (:func:`choice_requests`): choice ``i`` of a request with seed ``s`` decodes with
:func:`choice_seed` ``(s, i)``, which is ``s`` itself for choice 0 (so choice 0 of ``n`` is the
plain request with seed ``s``) and a splitmix hash of ``(s, i)`` for the others, so each choice
has its own draft and verify streams (:mod:`osd.decode.rng`), independent of its siblings'.

The group shares its prompt's prefill. The first choice is the group's *leader*: only it runs
the prompt through the target (:func:`osd.decode.step.prefill`, chunked as any prompt); its
``followers`` (the other choices' rows, admitted with it, each in KV slots of its own) wait.
When the leader's prompt is complete, :func:`share_prompt` copies the prompt's keys and values
from the leader's slot into each follower's target cache (the draft reads a prompt only when it
first drafts for a row, each choice for itself: :mod:`osd.decode.drafting`), and gives every
choice the leader's logits after the prompt, from which each samples its own first
token with its own stream. From then on the choices are independent rows of the batch. Token for
token, choice ``i`` equals a request decoded alone with seed ``choice_seed(s, i)``: the prompt's
KV and first logits are the same numbers, and every draw after is addressed by the row's own
streams.
"""

from __future__ import annotations

import dataclasses

import torch

from osd.decode import rng
from osd.decode.forward import ModelPair, as_tensor
from osd.decode.request import DecodeRequest
from osd.decode.rows import Row
from osd.errors import ParamError

__all__ = ["check_group", "choice_requests", "choice_seed", "share_prompt"]

# Stream number of the choice seeds' hash, apart from rng's draft and verify streams.
_CHOICE_STREAM = 0xC401CE


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed`` (an int64).

    Choice 0 keeps ``seed``; the others get a hash of ``(seed, index)``.
    """
    if index < 0:
        raise ValueError(f"choice index must be >= 0, got {index}")
    if index == 0:
        return seed
    return rng.stream_key(rng.stream_key(seed, _CHOICE_STREAM), index)


def choice_requests(request: DecodeRequest, n: int) -> list[DecodeRequest]:
    """The ``n`` choices of ``request``: copies with seeds :func:`choice_seed` ``(seed, i)``."""
    if n < 1:
        raise ParamError("n", f"n must be >= 1, got {n}")
    return [dataclasses.replace(request, seed=choice_seed(request.seed, i)) for i in range(n)]


def check_group(requests: list[DecodeRequest]) -> None:
    """Raises ValueError unless ``requests`` are choices of one request (equal but for seed)."""
    if not requests:
        raise ValueError("a group needs at least one request")
    first = requests[0]
    for request in requests[1:]:
        if dataclasses.replace(request, seed=first.seed) != first:
            raise ValueError("the requests of a group may differ only in their seed")


def share_prompt(
    pair: ModelPair, rows: list[Row], logits: torch.Tensor
) -> tuple[list[Row], torch.Tensor]:
    """Gives the followers of rows whose prompt just completed the leader's prefill.

    Args:
        pair: the models and their caches.
        rows: rows whose prompt is complete in the caches.
        logits: (P, V) the target's logits after each row's prompt.

    Returns:
        ``rows`` followed by their followers (now prefilled), and the logits of each: (P', V).
    """
    followers = [(p, f) for p, row in enumerate(rows) for f in row.followers]
    if not followers:
        return rows, logits
    moves: dict[str, list[tuple[int, int, int]]] = {"target": [], "draft": []}
    for p, follower in followers:
        leader = rows[p]
        slots = (leader.slots[0], follower.slots[0])
        moves["target"] += [(*slots, pos) for pos in range(leader.target_len)]
        # The draft's cache holds what the leader drafted from (nothing yet: the draft reads
        # a prompt only when it first drafts, osd.decode.drafting).
        moves["draft"] += [(*slots, pos) for pos in range(leader.draft_len)]
        follower.draft_len = leader.draft_len
        follower.target_len = leader.target_len
        follower.prompt_logprobs = leader.prompt_logprobs  # echo's: the same prompt's
    for row in rows:
        row.followers = []  # shared once: the group's rows are independent from here
    for name, cache in (("target", pair.target_cache), ("draft", pair.draft_cache)):
        if moves[name]:
            index = as_tensor(moves[name], logits.device)  # (N, 3)
            cache.copy_positions(index[:, 0], index[:, 1], index[:, 2])
    source = as_tensor([p for p, _ in followers], logits.device)
    return [*rows, *(f for _, f in followers)], torch.cat([logits, logits[source]])
