"""The grammar masks of one step, for the rows with structured output (:mod:`osd.decode.grammar`).

Position i of a row's block (and of each of its SpecTr branches) is masked by the row's
grammar after the tokens drafted before it, for the draft's q and the target's p alike, so the
verifiers see exactly the distributions tokens were drawn from. The masks are computed on the
host, in the decode thread (llguidance's thread pool only for many masks at once): once the
draft's forward for position i is queued, each branch's matcher consumes its drafted token
i - 1 and fills the mask of position i; after the last drafted token it fills position k, the
target's bonus position, while the target's forward is queued. On a GPU the drafted tokens
reach the host by a copy started before that forward (:meth:`GrammarMasks.prefetch`), so the
masks are computed while it runs. The same masks then go to the target in one copy. Branches
draft on copies of the row's matcher (a copy costs about a microsecond): once the step's tokens
are known, the row's own matcher, still at the step's start, advances by what the row emitted.
(No rollback: llguidance 1.9's rollback over a special token, such as Mistral's ``[TOOL_CALLS]``,
says it succeeded and leaves the parser in the wrong place once masks were computed.)

A stop token (end-of-sequence or the request's stop ids) is never consumed: the row ends there,
and positions after it are left unmasked (what is drafted after a stop is never emitted).
Only rows with a grammar cost anything: a step without one never builds this object.

A grammar that fails while decoding (llguidance refuses a token or runs out of a resource
limit: something compiling the grammar cannot always foresee) fails its own request only: the
row gets the error (``Row.error``), its masks stop (its last tokens are never returned), and the
loop ends that request with the error while the rest of the batch goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from osd.decode.grammar import GrammarFailed, consume, unpack_bitmask
from osd.decode.rows import Row
from osd.devices import to_device

__all__ = ["GrammarMasks"]

_executor: Any = None
# Masks filled in the calling thread up to this many per call, in llguidance's pool above it:
# a mask of a parser state seen before takes microseconds, less than waking pool threads that
# may be competing with torch's for the cores (measured: bench/bench_structured.py).
_SERIAL_FILLS = 64
_executor_lock = threading.Lock()


def _pool() -> Any:
    """llguidance's mask thread pool, one per process."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        return _executor


@dataclass
class _Branch:
    """One branch of a constrained row during the step."""

    row: Row
    matcher: Any  # a copy of the row's, which stays at the step's start
    index: int  # its row in the step's fan-out (row b's branch j: sum(branches[:b]) + j)
    batch_row: int  # b
    branch: int  # j
    k: int  # tokens it drafts this step
    at: int = 0  # drafted tokens it has reached
    ended: bool = False  # a stop token was drafted


class GrammarMasks:
    """Masks of one step, from position 0 (build one only when :meth:`needed`).

    Args:
        rows: the step's rows.
        spec_k: tokens each row drafts.
        branches: draft sequences per row (1, or K for SpecTr).
        width: the step's widest k (positions 0..width are masked).
        vocab_size: the models' vocabulary.
        device: where the models run.
    """

    def __init__(
        self,
        rows: Sequence[Row],
        spec_k: Sequence[int],
        branches: Sequence[int],
        width: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.width, self.vocab_size, self.device = width, vocab_size, device
        words = (vocab_size + 31) // 32
        self.bits = torch.full((sum(branches), width + 1, words), -1, dtype=torch.int32)
        self.first = [sum(branches[:b]) for b in range(len(rows))]
        self._fetched: tuple[int, torch.Tensor, Any] | None = None  # (position, host ids, event)
        self.branches: list[_Branch] = []
        for b, row in enumerate(rows):
            if row.matcher is None:
                continue
            for j in range(branches[b]):
                matcher = row.matcher.deep_copy()
                self.branches.append(_Branch(row, matcher, self.first[b] + j, b, j, spec_k[b]))
        self._fill([(branch, 0) for branch in self.branches])

    @staticmethod
    def needed(rows: Sequence[Row]) -> bool:
        """Whether a row of the step has a grammar (without one, a step builds no masks)."""
        return any(row.matcher is not None for row in rows)

    def advance(self, position: int, ids: torch.Tensor) -> None:
        """Brings every branch to ``min(position, its k)`` drafted tokens and fills its mask
        there.

        Args:
            position: the position about to be drafted (``width``: the bonus position).
            ids: (B, K, width) the tokens drafted so far (positions below ``position``).
        """
        moving = [b for b in self.branches if min(position, b.k) > b.at]
        if not moving:
            return
        fetched = self._fetched if self._fetched and self._fetched[0] == position else None
        if fetched is not None:  # copied while the forward ran: wait for the copy alone
            fetched[2].synchronize()
            drafted = [fetched[1][b.batch_row, b.branch].tolist() for b in moving]
        else:
            at = torch.tensor([[b.batch_row, b.branch] for b in moving], device=ids.device)
            drafted = ids[at[:, 0], at[:, 1], :position].tolist()  # a host sync
        fills = []
        for branch, tokens in zip(moving, drafted, strict=True):
            target = min(position, branch.k)
            for token in tokens[branch.at : target]:
                if branch.ended:
                    break
                if token in branch.row.request.stop_token_ids:
                    branch.ended = True
                    break
                if not consume(branch.matcher, token, branch.row.request.grammar):
                    _broken(branch, f"refused token {token}")
                    break
            branch.at = target
            if not branch.ended:
                fills.append((branch, target))
        self._fill(fills)

    def prefetch(self, position: int, ids: torch.Tensor) -> None:
        """On a GPU, starts copying the tokens drafted below ``position`` to the host without
        waiting, so that :meth:`advance` at ``position``, called after the next forward is
        queued, waits for this copy only and computes the masks while that forward runs."""
        if ids.device.type != "cuda":
            return
        host = torch.empty(ids[:, :, :position].shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids[:, :, :position], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._fetched = (position, host, done)

    def draft_allowed(
        self, batch_rows: Sequence[int], branch_of: Sequence[int], position: int
    ) -> torch.Tensor:
        """(A, V) bool on the device: the mask of each (row, branch) at ``position``."""
        index = [self.first[b] + j for b, j in zip(batch_rows, branch_of, strict=True)]
        return self._on_device(self.bits[index, position])

    def target_allowed(self, num_positions: int) -> torch.Tensor:
        """(R, num_positions, V) bool on the device: every fan-out row's masks."""
        return self._on_device(self.bits[:, :num_positions])

    def commit(self, emitted: Sequence[Sequence[int]]) -> None:
        """Advances each row's matcher, at the step's start, by what the row emitted.

        Args:
            emitted: per batch row, the tokens it emitted this step, in order.
        """
        for branch in self.branches:
            if branch.branch != 0 or branch.row.error is not None:
                continue  # one matcher a row; a failed row ends
            branch.matcher = branch.row.matcher
            for token in emitted[branch.batch_row]:
                if token in branch.row.request.stop_token_ids:
                    break
                if not consume(branch.matcher, token, branch.row.request.grammar):
                    _broken(branch, f"refused token {token}")
                    break

    def _fill(self, fills: list[tuple[_Branch, int]]) -> None:
        if not fills:
            return
        flat = self.bits.view(-1, self.bits.shape[-1])
        slots = [branch.index * (self.width + 1) + position for branch, position in fills]
        mask_bytes = flat.shape[-1] * 4
        if len(fills) <= _SERIAL_FILLS:  # in this thread: a handoff costs more than the work
            for (branch, _), slot in zip(fills, slots, strict=True):
                branch.matcher.unsafe_compute_mask_ptr(flat[slot].data_ptr(), mask_bytes)
        else:
            _pool().unsafe_compute_mask_ptr(
                [(branch.matcher, slot) for (branch, _), slot in zip(fills, slots, strict=True)],
                flat.data_ptr(),
                mask_bytes,
                flat.shape[0],
            )
        for branch, slot in zip((b for b, _ in fills), slots, strict=True):
            if branch.matcher.is_error():
                _broken(branch, "it failed")
                flat[slot] = -1  # any token: the row's output is not returned
            elif not flat[slot].any():  # nothing allowed: end the output rather than divide by 0
                eos = min(branch.row.request.stop_token_ids, default=0)
                bit = 1 << (eos % 32)
                flat[slot, eos // 32] = bit - (1 << 32 if bit >= 1 << 31 else 0)  # as int32

    def _on_device(self, bits: torch.Tensor) -> torch.Tensor:
        return unpack_bitmask(to_device(bits.contiguous(), self.device), self.vocab_size)


def _broken(branch: _Branch, what: str) -> None:
    """Fails the branch's request (once) and stops its masks."""
    branch.ended = True
    if branch.row.error is None:
        detail = branch.matcher.get_error().strip().splitlines()
        branch.row.error = GrammarFailed(
            f"structured output failed: the grammar's parser {what}"
            + (f" ({detail[0]})" if detail else "")
        )
