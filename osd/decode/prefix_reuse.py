"""Prompts that begin as an earlier one did skip that beginning's prefill (prefix caching).

A slot's target KV at positions ``[0, target_len)`` is the keys and values of the row's first
``target_len`` tokens, and nothing rewrites them while the row lives; after it leaves they stay
until the slot is handed out again. So a joining prompt that begins with tokens another slot
holds (a row still decoding, or a free slot whose row left) gets those positions copied into its
own slot (:meth:`osd.decode.kv_cache.SlotKVCache.copy_positions`, a memory copy) and is
prefilled from there: the template of templated traffic, a chat's system prompt, a prompt asked
again. vLLM's automatic prefix caching does the same over its KV blocks.

The KV of a position depends only on the tokens up to it (the target runs no per-row adapter),
so the copied positions are the ones the prompt's own prefill would have written, up to the
floating-point rounding of a forward of another shape (as vLLM's). Only the target's cache is
shared: the draft reads a prompt only when it first drafts, under the row's own adapter. Caches
with windowed layers keep a ring of recent positions per slot, overwritten as the row went on:
no reuse there.

Pure: the bookkeeping of what free slots hold, and the choice of a source.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["SlotContents", "common_prefix"]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two int64 arrays share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class SlotContents:
    """The tokens whose target KV each free slot still holds, and the best source for a prompt.

    Args:
        min_tokens: the shortest shared beginning worth a copy (shorter ones are prefilled).
    """

    def __init__(self, min_tokens: int = 8) -> None:
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.min_tokens = min_tokens
        self._held: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, slot: int, tokens: Sequence[int]) -> None:
        """A slot just freed holds the KV of ``tokens`` (its row's first ``target_len``); the
        newest kept (:meth:`preserve` forgets the oldest)."""
        self._held.pop(slot, None)
        if len(tokens) >= self.min_tokens:
            self._held[slot] = np.asarray(tokens, dtype=np.int64)

    def take(self, slots: Iterable[int]) -> dict[int, np.ndarray]:
        """Slots handed out (to a joiner, or as a moved row's new place): their contents are
        no longer kept, since they will be overwritten; returns what they held."""
        return {slot: held for slot in slots if (held := self._held.pop(slot, None)) is not None}

    def preserve(
        self, taken: dict[int, np.ndarray], free: Sequence[int]
    ) -> list[tuple[int, int, int]]:
        """Keeps what slots just handed out held (``take``'s result) in ``free`` slots nobody
        is given this turn: an empty one first (the highest: joiners take the lowest), else
        the one kept longest ago (its contents forgotten). Returns the copies to make (src,
        dst, positions) before anything writes the handed-out slots. Without it the free
        slots would keep only what the lowest ones last held: at one client, every request's
        successor overwrote it (joiners take the lowest free slot, so that the batch's slots
        stay consecutive)."""
        copies: list[tuple[int, int, int]] = []
        spare = [slot for slot in free if slot not in self._held]
        written: set[int] = set()  # one destination a call: the copies run as one
        for slot, tokens in taken.items():
            if any(common_prefix(held, tokens) == len(tokens) for held in self._held.values()):
                continue  # another free slot holds it already
            if spare:
                dst = spare.pop()
            else:
                older = [kept for kept in self._held if kept in free and kept not in written]
                if not older:
                    break
                dst = older[0]  # the oldest
                del self._held[dst]
            copies.append((slot, dst, len(tokens)))
            written.add(dst)
            self._held[dst] = tokens
        return copies

    def best(
        self,
        prompt: Sequence[int],
        own: tuple[int, np.ndarray | None],
        live: Sequence[tuple[int, Sequence[int]]],
    ) -> tuple[int, int]:
        """(source slot, positions) to copy for ``prompt``: the longest beginning it shares,
        at most all but its last token (whose logits the prefill must compute), with the row's
        own slot (``own``: its number and what it held), the kept free slots and the ``live``
        rows (slot, tokens in its cache). (own slot, 0) where none shares ``min_tokens``."""
        slot, held = own
        tokens = np.asarray(prompt, dtype=np.int64)
        cap = len(tokens) - 1
        best = (slot, 0)
        if cap < self.min_tokens:
            return best
        head = int(tokens[0])
        candidates: list[tuple[int, Sequence[int] | np.ndarray]] = [
            *([] if held is None else [(slot, held)]),  # first: a tie needs no copy
            *self._held.items(),
            *live,
        ]
        for source, seen in candidates:
            if len(seen) < self.min_tokens or int(seen[0]) != head:
                continue
            shared = common_prefix(tokens[:cap], np.asarray(seen[:cap], dtype=np.int64))
            if shared > best[1]:
                best = (source, shared)
        return best if best[1] >= self.min_tokens else (slot, 0)
