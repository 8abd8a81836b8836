"""Each row's token counts on the device, for the penalties (osd.decode.prefix_history.History).

Kept per KV slot (a row's ``slots[0]``), allocated on the first row that uses a penalty and
brought up to date incrementally: a step sends only the tokens rows emitted since the last one
(a new row on a slot starts from its prompt). Rows without a penalty cost nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from osd.decode.prefix_history import History
from osd.decode.rows import Row
from osd.devices import to_device

__all__ = ["TokenHistory"]


class TokenHistory:
    """Counts of generated tokens and the set of prompt or generated tokens, per slot.

    Args:
        num_slots: KV slots of the engine.
        vocab_size: the models' vocabulary.
        device: where the tables live (the models' device).
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, device
        self._counts: torch.Tensor | None = None
        self._seen: torch.Tensor | None = None
        # slot -> (the row it was brought up to date for, generated tokens counted so far)
        self._synced: dict[int, tuple[weakref.ref[Row], int]] = {}

    def of(self, rows: Sequence[Row]) -> History:
        """The rows' histories, (len(rows), V), after bringing them up to date."""
        if self._counts is None or self._seen is None:
            self._counts = torch.zeros(self.num_slots, self.vocab_size, device=self.device)
            self._seen = torch.zeros(
                self.num_slots, self.vocab_size, dtype=torch.bool, device=self.device
            )
        fresh: list[int] = []
        seen_at: list[tuple[int, int]] = []  # (slot, token): tokens that become seen
        counted_at: list[tuple[int, int]] = []  # (slot, token): generated tokens to count
        for row in rows:
            slot, prompt_len = row.slots[0], len(row.request.prompt_ids)
            owner, done = self._synced.get(slot, (None, 0))
            if owner is None or owner() is not row:
                fresh.append(slot)
                seen_at += [(slot, t) for t in row.request.prompt_ids]
                done = 0
            new = row.seq[prompt_len + done :]
            counted_at += [(slot, t) for t in new]
            self._synced[slot] = (weakref.ref(row), len(row.seq) - prompt_len)
        if fresh:
            index = self._index([(s,) for s in fresh])[:, 0]
            self._counts[index] = 0
            self._seen[index] = False
        if seen_at or counted_at:
            pairs = self._index(seen_at + counted_at)
            self._seen[pairs[:, 0], pairs[:, 1]] = True
            if counted_at:
                at = pairs[len(seen_at) :]
                ones = torch.ones(len(counted_at), device=self.device)
                self._counts.index_put_((at[:, 0], at[:, 1]), ones, accumulate=True)
        slots = self._index([(row.slots[0],) for row in rows])[:, 0]
        return History(self._counts[slots], self._seen[slots])

    def _index(self, rows: Sequence[tuple[int, ...]]) -> torch.Tensor:
        return to_device(torch.tensor(rows, dtype=torch.int64), self.device)
