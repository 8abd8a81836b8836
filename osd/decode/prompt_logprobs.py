"""The target's prefill forward with the prompt's logprobs for the rows that ask (OpenAI's
``echo`` with ``logprobs``): the rows' side of :mod:`osd.decode.logprobs`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from osd.decode.logprobs import PromptLogprobs, gather_logprobs
from osd.decode.rows import Row
from osd.devices import to_device

__all__ = ["prefill_target"]


def prefill_target(
    pieces: list[tuple[Row, int]],
    forward: Callable[[list[tuple[Row, int]], int], torch.Tensor],
) -> torch.Tensor:
    """The target's prefill forward of ``pieces``, gathering prompt logprobs for rows that ask.

    Rows without ``prompt_logprobs`` run as one forward keeping the last position's logits;
    rows with it in a second forward keeping every position's (left-padded, so a row's tokens
    are its last columns), whose logprobs start on their way to the host.

    Args:
        pieces: (row, number of its prompt tokens in this chunk), before ``target_len``
            moves past them.
        forward: runs the target over some pieces keeping the given number of last positions'
            logits: (len(pieces), num_logits, V).

    Returns:
        (P, V) the logits after each piece's last token, in order.
    """
    asking = [i for i, (row, _) in enumerate(pieces) if row.request.prompt_logprobs is not None]
    if not asking:
        return forward(pieces, 1)[:, 0]
    others = [i for i in range(len(pieces)) if i not in asking]
    group = [pieces[i] for i in asking]
    width = max(size for _, size in group)
    logits = forward(group, width)  # (G, W, V)
    _start_prompt_logprobs(group, logits)
    if not others:
        return logits[:, -1]
    last = torch.empty(len(pieces), logits.shape[-1], dtype=logits.dtype, device=logits.device)
    last[asking] = logits[:, -1]
    last[others] = forward([pieces[i] for i in others], 1)[:, 0]
    return last


def _start_prompt_logprobs(group: list[tuple[Row, int]], logits: torch.Tensor) -> None:
    """Starts each row's chunk of prompt logprobs: position j scores the prompt token after it."""
    width = logits.shape[1]
    next_ids = torch.zeros(len(group), width, dtype=torch.int64)  # (G, W); padding and past
    for g, (row, size) in enumerate(group):  # the prompt's end (the first new token): 0
        start, prompt = row.target_len, row.request.prompt_ids
        following = prompt[start + 1 : start + size + 1]
        next_ids[g, width - size : width - size + len(following)] = torch.tensor(following)
    num_top = [row.request.prompt_logprobs or 0 for row, _ in group]
    index = to_device(torch.arange(len(group)), logits.device)
    pending = gather_logprobs(
        logits, index, to_device(next_ids, logits.device), list(range(len(group))), num_top
    )
    for g, (row, size) in enumerate(group):
        kept = min(size, len(row.request.prompt_ids) - 1 - row.target_len)
        if row.prompt_logprobs is None:
            row.prompt_logprobs = PromptLogprobs()
        row.prompt_logprobs.parts.append((pending, g, slice(width - size, width - size + kept)))
