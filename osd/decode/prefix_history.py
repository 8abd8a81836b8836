"""What the penalties see of a row's prefix (osd.decode.sampling applies them): token counts and the
set of tokens seen, for one position or for every position of a drafted block, where position i
also counts the drafted tokens before it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["History", "block_history", "extend_history"]


@dataclass(frozen=True)
class History:
    """What the penalties see of each row's prefix, broadcastable to the logits' shape.

    Attributes:
        counts: (..., V) float: times each token was generated so far.
        seen: (..., V) bool: tokens of the prompt or generated so far.
    """

    counts: torch.Tensor
    seen: torch.Tensor

    @staticmethod
    def of(
        prompt_ids: Sequence[int], output_ids: Sequence[int], vocab_size: int, device: str = "cpu"
    ) -> History:
        """One row's history: its prompt and the tokens generated after it."""
        counts = torch.zeros(vocab_size, device=device)
        counts.index_add_(
            0,
            torch.tensor(list(output_ids), dtype=torch.int64, device=device),
            torch.ones(len(output_ids), device=device),
        )
        seen = counts > 0
        seen[torch.tensor(list(prompt_ids), dtype=torch.int64, device=device)] = True
        return History(counts, seen)


def extend_history(history: History, block: torch.Tensor) -> History:
    """The history after each row's ``block`` (B, n) of drafted tokens, (B, V)."""
    counts = history.counts.scatter_add(-1, block, torch.ones_like(block, dtype=torch.float32))
    return History(counts, history.seen | (counts > 0))


def block_history(history: History, block: torch.Tensor) -> History:
    """The history at each position of a drafted block: position i also counts ``block[:, :i]``.

    Args:
        history: (B, V) before the block.
        block: (B, P - 1) drafted tokens.

    Returns:
        (B, P, V) histories for positions 0..P-1.
    """
    num_rows, width = block.shape
    vocab_size = history.counts.shape[-1]
    one_hot = torch.zeros(num_rows, width, vocab_size, device=block.device)
    one_hot.scatter_(-1, block.unsqueeze(-1), 1.0)
    start = torch.zeros(num_rows, 1, vocab_size, device=block.device)
    before = torch.cat([start, one_hot.cumsum(dim=1)], dim=1)
    counts = history.counts.unsqueeze(1) + before
    return History(counts, history.seen.unsqueeze(1) | (before > 0))
