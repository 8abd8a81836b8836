"""The model pair of a batched engine and one ragged forward of either model over rows.

Rows are laid out left-padded to one width (:func:`left_padded`) and run through
:func:`run_model` with their KV slots (:mod:`osd.decode.kv_cache`); the step
(:mod:`osd.decode.step`) and the drafting (:mod:`osd.decode.drafting`) build on these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from osd.decode.compiled_forward import FEW_TOKENS
from osd.decode.goodput import GoodputController
from osd.decode.history import TokenHistory
from osd.decode.kv_cache import SlotKVCache, packing, plan_forward, worth_packing
from osd.decode.log_top_m import LogTopM
from osd.decode.models import CausalLM
from osd.decode.prefix_history import History
from osd.decode.proposers import Proposers
from osd.decode.rows import Row
from osd.decode.sampling import RowSampling
from osd.devices import to_device

__all__ = [
    "ModelPair",
    "as_tensor",
    "computed_positions",
    "history_rows",
    "left_padded",
    "right_aligned",
    "run_model",
]


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
    # Who drafts each row (osd.decode.proposers); the default: the draft model alone.
    proposers: Proposers = field(default_factory=Proposers)
    history: TokenHistory = field(init=False)  # token counts of rows with a penalty
    # Starts each step's top-m for the log (beside the decoding thread on a CPU).
    log_distribution: LogTopM = field(init=False)
    # The models' device and the target's dtype, read once: a step asks for them, and asking
    # a model walks its parameters (the models do not move or change dtype while a pair serves;
    # the dtype read every step was 1 % of a batch-1 step on the CPU).
    device: torch.device = field(init=False)
    dtype: torch.dtype = field(init=False)
    # The last step's rows and their sampling tensors: a step over the same rows (the steady
    # state) reuses them instead of building and copying them to the device again.
    _sampled_rows: tuple[Row, ...] = field(init=False, default=())
    _sampling: RowSampling | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.device = self.target.device
        self.dtype = next(self.target.model.parameters()).dtype
        self.history = TokenHistory(self.target_cache.num_slots, self.vocab_size, self.device)
        self.log_distribution = LogTopM(self.log_top_m, self.device)

    def sampling(self, rows: list[Row]) -> tuple[RowSampling, History | None]:
        """The rows' sampling parameters (the last step's tensors where its rows were these,
        in this order: a request's parameters never change), and their histories when a
        penalty needs them."""
        sampling = self._sampling
        if (
            sampling is None
            or len(rows) != len(self._sampled_rows)
            or any(a is not b for a, b in zip(rows, self._sampled_rows, strict=True))
        ):
            params = [r.request.params for r in rows]
            sampling = RowSampling.of(params, self.device, self.vocab_size)
            self._sampled_rows, self._sampling = tuple(rows), sampling
        return sampling, self.history.of(rows) if sampling.any_history else None

    @torch.inference_mode()
    def move_rows(self, moves: Sequence[tuple[Row, int]]) -> None:
        """Moves each row (one slot each) to the free slot given with it: the positions its
        target and draft caches hold are copied there, in one copy per layer for all rows.
        (A penalty's token counts follow by themselves: :class:`TokenHistory` rebuilds a
        slot's counts when another row holds it.)"""
        assert all(len(row.slots) == 1 for row, _ in moves), "rows with scratch slots stay"
        target = [(row.slots[0], dst, row.target_len) for row, dst in moves]
        draft = [(row.slots[0], dst, row.draft_len) for row, dst in moves]
        _copy_prefixes(self.target_cache, target, self.device)
        _copy_prefixes(self.draft_cache, draft, self.device)
        for row, dst in moves:
            row.slots = [dst]

    @torch.inference_mode()
    def copy_prefixes(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copies the target's first ``n`` cached positions of slot ``src`` into slot ``dst``,
        for each (src, dst, n), in one copy per layer (:mod:`osd.decode.prefix_reuse`; the
        draft's cache is the rows' own: it reads a prompt when it first drafts)."""
        _copy_prefixes(self.target_cache, copies, self.device)


def _copy_prefixes(
    cache: SlotKVCache, copies: Sequence[tuple[int, int, int]], device: torch.device
) -> None:
    """The first ``n`` positions of slot ``src`` into slot ``dst``, for each (src, dst, n):
    one (src, dst, position) index per copied position, built without a Python loop over
    them (a shared preamble is hundreds of positions a joiner, on the decode thread)."""
    if not copies:
        return
    src, dst, counts = torch.tensor(copies, dtype=torch.int64).T
    total = int(counts.sum())
    if total == 0:
        return
    starts = torch.cumsum(counts, 0) - counts  # each copy's first index in the flat list
    positions = torch.arange(total) - starts.repeat_interleave(counts)
    at = to_device(
        torch.stack([src.repeat_interleave(counts), dst.repeat_interleave(counts), positions]),
        device,
    )  # (3, N): src, dst, position
    cache.copy_positions(at[0], at[1], at[2])


def as_tensor(
    values: Sequence[int] | Sequence[Sequence[int]], device: torch.device
) -> torch.Tensor:
    """int64 values on ``device``."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def left_padded(
    token_lists: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Rows of tokens, left-padded to one width: (B, T) ids, each row's padding and length."""
    width = max(len(tokens) for tokens in token_lists)
    lengths = [len(tokens) for tokens in token_lists]
    rows = [[0] * (width - len(tokens)) + tokens for tokens in token_lists]
    return as_tensor(rows, device), [width - n for n in lengths], lengths


def run_model(
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
    then right padding; only the real tokens are computed where the model packs and the
    padding is worth skipping (:func:`osd.decode.kv_cache.packing`), the rows then right-
    aligned for attention (:func:`right_aligned`; the logits come back in these columns)."""
    device = input_ids.device
    width = input_ids.shape[1]
    packs = model.packs and worth_packing(num_real, width)
    logits_left = left
    if packs and any(pad + n < width for pad, n in zip(left, num_real, strict=True)):
        input_ids, left = right_aligned(input_ids, left, num_real)
    # Rows in consecutive slots, each reading only its own, read their keys in place.
    first = own[0] if own else 0
    consecutive = bool(own) and all(
        o == first + b and (p == 0 or s == o)
        for b, (o, s, p) in enumerate(zip(own, base, prefix, strict=True))
    )
    # One host-to-device copy for the six per-row columns of the plan.
    columns = as_tensor([start, left, num_real, own, base, prefix], device)
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
        layout=model.attention,
        max_real=max(num_real),
        first_slot=first if consecutive else None,
        packed=(
            packing(
                left,
                num_real,
                width,
                num_logits,
                device,
                narrow=FEW_TOKENS,
                logits_left=logits_left,
            )
            if packs
            else None
        ),
    )
    return model.run(plan, cache, num_logits=num_logits, adapters=adapters)


def right_aligned(
    input_ids: torch.Tensor, left: list[int], num_real: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """Rows laid out as ``left`` padding, ``num_real`` tokens, then right padding, moved so that
    each row's tokens fill its last columns: (ids, left padding).

    A packed forward's attention sees the grid, and a verify step right-pads the rows that
    verify fewer tokens than the widest: their one or two tokens then sit in the grid's first
    columns, beside a row's eight looked-up ones, and the attention cannot split so that they
    attend with their own few queries (:func:`osd.decode.kv_cache.attention_split`). Right-
    aligned, it can. Only the attention's grid moves: positions, cache writes and masks
    follow the tokens, and the logits go back to the caller's columns (``packing``'s
    ``logits_left``)."""
    width = input_ids.shape[1]
    shifts = as_tensor(
        [width - pad - n for pad, n in zip(left, num_real, strict=True)], input_ids.device
    )
    columns = torch.arange(width, device=input_ids.device)
    moved = input_ids.gather(1, (columns.unsqueeze(0) - shifts.unsqueeze(1)) % width)
    return moved, [width - n for n in num_real]


def computed_positions(model: CausalLM, num_real: list[int], width: int) -> int:
    """Positions :func:`run_model` computes for rows of ``num_real`` tokens in a grid ``width``
    wide: their real tokens where it packs them, else the whole grid."""
    if model.packs and worth_packing(num_real, width):
        return sum(num_real)
    return len(num_real) * width


def history_rows(history: History | None, index: torch.Tensor) -> History | None:
    return None if history is None else History(history.counts[index], history.seen[index])
