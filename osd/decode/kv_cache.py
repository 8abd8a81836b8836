"""KV memory per row: a slot cache with per-row lengths, read and written through a plan.

Why not transformers' ``PagedAttentionCache``: it is driven by its own continuous-batching
manager (flattened varlen batches, its own scheduler and block allocator) and has no call to
cut one sequence back to a shorter prefix, which speculative decoding needs after every
rejection. Here a row's cache is a *slot*: a row of one preallocated tensor per layer, shape
``(num_slots + 1, capacity, kv_heads, head_dim)``, plus a length the engine keeps. Rolling a row
back to its kept prefix costs nothing (its length shrinks; stale positions are overwritten by
the next forward and masked until then). Any subset of rows can run a forward: a
:class:`ForwardPlan` says, for each input position, which slot and position its key/value is
written to, and for each row which slots its keys are read from (a SpecTr branch reads the
shared prefix from its request's slot and its own tokens from a scratch slot, so the prefix is
never copied). Padding writes go to one trash slot (the last).

The plan's 4-D additive mask goes to the model as is (transformers 5 passes a 4-D mask through),
with explicit position ids, so any attention implementation that takes a mask works (eager,
sdpa); a model with sliding-window or chunked layers gets them in its masks
(:mod:`osd.decode.attention`), one mask per layer kind where it mixes kinds. Rows in consecutive
slots that read only their own (the decode loop keeps its rows in slot order) read their keys
in place, as one strided view of the storage; other forwards (SpecTr branches reading a shared
prefix, rows in scattered slots, a wrapped ring) gather the rows' keys per layer, a copy a
paged-attention kernel would avoid on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from osd.decode.attention import AttentionLayout, layout_masks
from osd.devices import to_device

__all__ = [
    "ForwardPlan",
    "SlotKVCache",
    "kept_positions",
    "AttentionSplit",
    "Packing",
    "attention_split",
    "packing",
    "worth_packing",
    "plan_forward",
    "plan_one_row",
    "plan_zero_rows",
]

_MIN_CAPACITY = 64


@dataclass
class ForwardPlan:
    """Where one batched forward reads and writes KV, and what each query may see.

    Attributes:
        input_ids: (B, T) tokens; padding columns hold 0.
        position_ids: (B, T) absolute positions (0 for left padding).
        write_slot: (B, T) slot each column's key/value goes to (the trash slot for padding).
        write_pos: (B, T) position within that slot.
        read_slot: (B, S) slot each row reads key position s from.
        attention_mask: (B, 1, T, S) additive mask (0 or the dtype's minimum), or one per
            layer kind for a model that mixes kinds (:mod:`osd.decode.attention`).
        max_real: most real tokens of one row (host int).
        first_slot: when row b reads only slot ``first_slot + b`` (no shared prefix from
            another slot), that first slot: the rows' keys are then one strided view of the
            storage and are read in place, without a gather (host int; None: gather).
        packed: which columns a forward computes when it computes only the real tokens
            (:func:`packing`, :meth:`SlotKVCache.update_packed`); None: every column, padding
            included.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    write_slot: torch.Tensor
    write_pos: torch.Tensor
    read_slot: torch.Tensor
    attention_mask: torch.Tensor | dict[str, torch.Tensor]
    max_real: int
    first_slot: int | None = None
    packed: Packing | None = None

    @property
    def kv_len(self) -> int:
        return int(self.read_slot.shape[1])

    @staticmethod
    def make_dummy(
        batch: int = 2, length: int = 3, trash: int = 8, device: str = "cpu"
    ) -> ForwardPlan:
        """A plan for ``batch`` fresh rows in slots 0..batch-1 with ``length`` tokens each."""
        return plan_forward(
            input_ids=torch.ones(batch, length, dtype=torch.int64, device=device),
            start=torch.zeros(batch, dtype=torch.int64, device=device),
            left=torch.zeros(batch, dtype=torch.int64, device=device),
            real=torch.full((batch,), length, dtype=torch.int64, device=device),
            own_slot=torch.arange(batch, device=device),
            base_slot=torch.arange(batch, device=device),
            prefix_len=torch.zeros(batch, dtype=torch.int64, device=device),
            trash_slot=trash,
            dtype=torch.float32,
        )


def plan_forward(
    *,
    input_ids: torch.Tensor,
    start: torch.Tensor,
    left: torch.Tensor,
    real: torch.Tensor,
    own_slot: torch.Tensor,
    base_slot: torch.Tensor,
    prefix_len: torch.Tensor,
    trash_slot: int,
    dtype: torch.dtype,
    kv_len: int | None = None,
    layout: AttentionLayout | None = None,
    max_real: int | None = None,
    first_slot: int | None = None,
    packed: Packing | None = None,
) -> ForwardPlan:
    """Plans a ragged forward: row b's real tokens are columns ``left[b] .. left[b]+real[b]-1``.

    Args:
        input_ids: (B, T) tokens laid out with left padding, real tokens, right padding.
        start: (B,) absolute position of row b's first real token (its cached length).
        left: (B,) left padding columns.
        real: (B,) real tokens (written to the cache); later columns are right padding.
        own_slot: (B,) slot the row's tokens are written to and its positions >= prefix_len
            are read from.
        base_slot: (B,) slot positions < prefix_len are read from (own_slot for plain rows).
        prefix_len: (B,) shared-prefix length read from base_slot.
        trash_slot: index of the slot that takes padding writes.
        dtype: the model's dtype, for the additive mask.
        kv_len: ``max(start + real)`` when the caller knows it on the host (saves a device
            sync); computed otherwise.
        layout: the model's attention pattern (sliding windows, chunks); None: every layer
            attends to all earlier positions.
        max_real: ``max(real)`` when the caller knows it on the host; computed otherwise.
        first_slot: set when row b reads only slot ``first_slot + b`` (the caller knows it on
            the host: :attr:`ForwardPlan.first_slot`).
        packed: the columns a forward computes when not all (:func:`packing`).
    """
    batch, width = input_ids.shape
    device = input_ids.device
    columns = torch.arange(width, device=device)  # (T,)
    offset = columns.unsqueeze(0) - left.unsqueeze(1)  # (B, T)
    positions = start.unsqueeze(1) + offset  # (B, T)
    valid = (offset >= 0) & (offset < real.unsqueeze(1))
    # Padding queries sit at position 0: a position past a row's real end could exceed the
    # model's context (learned position embeddings) or rescale RoPE for the whole forward.
    query_pos = torch.where(valid, positions, 0)
    if kv_len is None:
        kv_len = int((start + real).max()) if batch else 0
    if max_real is None:
        max_real = int(real.max()) if batch else 0
    keys = torch.arange(kv_len, device=device)  # (S,)
    read_slot = torch.where(
        keys.unsqueeze(0) < prefix_len.unsqueeze(1), base_slot.unsqueeze(1), own_slot.unsqueeze(1)
    )  # (B, S)
    visible = keys.view(1, 1, -1) <= query_pos.unsqueeze(-1)  # (B, T, S)
    return ForwardPlan(
        input_ids=input_ids,
        position_ids=query_pos,
        write_slot=torch.where(valid, own_slot.unsqueeze(1), trash_slot),
        write_pos=torch.where(valid, positions, 0),
        read_slot=read_slot,
        attention_mask=layout_masks(layout or AttentionLayout.full(), query_pos, visible, dtype),
        max_real=max_real,
        first_slot=first_slot,
        packed=packed,
    )


@dataclass(frozen=True)
class Packing:
    """Which columns of a forward's (B, T) grid are computed, when not all of them are.

    Attributes:
        index: (N,) the real tokens' indices in the flattened grid, in order.
        logits_from: (M,) which of the N computed tokens give logits (those in the last
            ``num_logits`` columns).
        logits_to: (M,) their places in the flattened (B, num_logits) logits; the other places
            (right padding) get logits 0, read by nobody.
        split: where a few rows reach far further left than the rest (a prompt read in a
            decode step beside rows of a token or a few: :func:`attention_split`), attention
            runs on two grids instead of the whole one: every row's last ``split.tail``
            columns, and the ``split.wide`` rows' columns before them. None: the whole grid.
    """

    index: torch.Tensor
    logits_from: torch.Tensor
    logits_to: torch.Tensor
    split: AttentionSplit | None = None


@dataclass(frozen=True)
class AttentionSplit:
    """Attention of a packed forward on two grids (:func:`attention_split`).

    Attributes:
        tail: columns of the tail grid: every row's last ``tail`` columns, (B, tail).
        wide: (R,) the rows with real tokens before those columns: the head grid is their
            first T - ``tail`` columns, (R, T - tail).
        index: (N,) each computed token's place in the two grids flattened one after the
            other (the tail grid's B x tail places, then the head grid's).
    """

    tail: int
    wide: torch.Tensor
    index: torch.Tensor


# The least columns of a split's tail and head grids: a size of 1 would be a compiled graph of
# its own (torch specializes it), and the tail's column of padding for rows of one token costs
# those rows' attention once more over their keys, a small part of a forward.
_SPLIT_LEAST_COLUMNS = 2
# What a wide row costs beyond its head grid's columns, in query columns of the tail grid: its
# keys and values copied out and SDPA's fixed cost per (row, head). Measured on the demo target
# (compiled, one thread, 150 keys): 12 rows of one token beside 4 of five, split at a tail of
# 2 (4 wide rows of 3 head columns: 76 columns by this count) 9.6-10.1 ms, on the whole grid
# (80) 10.4-11.0: a wide row costs its head and no more than about 8 columns besides.
_WIDE_ROW_COLUMNS = 8


def attention_split(
    left: Sequence[int], real: Sequence[int], width: int, narrow: int
) -> tuple[int, list[int]] | None:
    """(tail, wide rows) when a (B, ``width``) grid of rows laid out as ``left`` padding then
    ``real`` tokens attends on two smaller grids (:class:`AttentionSplit`), else None.

    A packed forward's attention otherwise runs on the whole grid: every row attends with the
    widest row's queries. One 50-token prompt beside 16 rows of one token (the demo target,
    compiled, one thread): 24.2 ms the forward, 10.4 split, against 6.9 for the 16 rows alone
    and 6.3 for the prompt alone (``docs/benchmarks.md``). One row verifying 8 looked-up tokens
    beside 15 verifying none, 150 keys: 15.6 ms whole, 9.8 split (a tail of 2), 9.0 for the 16
    rows of one token.

    The tail is one of the spans of the rows of at most ``narrow`` columns (at least two
    columns); the rows reaching further left are the wide rows. Of those tails, and the whole
    grid, the one with the fewest query columns is taken: B x tail, plus (T - tail +
    ``_WIDE_ROW_COLUMNS``) a wide row, against B x T; the head at least two columns wide."""
    spans = [width - pad if count else 0 for pad, count in zip(left, real, strict=True)]
    tails = {max(span, _SPLIT_LEAST_COLUMNS) for span in spans if 0 < span <= narrow}
    best: tuple[int, int, list[int]] | None = None  # (query columns, tail, wide rows)
    for tail in sorted(tails):
        wide = [b for b, span in enumerate(spans) if span > tail]
        if not wide or width - tail < _SPLIT_LEAST_COLUMNS:
            continue
        columns = len(left) * tail + len(wide) * (width - tail + _WIDE_ROW_COLUMNS)
        if columns < len(left) * width and (best is None or columns < best[0]):
            best = (columns, tail, wide)
    return None if best is None else (best[1], best[2])


def worth_packing(real: Sequence[int], width: int, share: float = 0.8) -> bool:
    """Whether a forward of rows with ``real`` tokens in a grid ``width`` columns wide computes
    only the real tokens (:func:`packing`): they are at most ``share`` of the grid (a fifth
    or more of it is padding)."""
    return len(real) > 1 and sum(real) <= share * len(real) * width


def packing(
    left: Sequence[int],
    real: Sequence[int],
    width: int,
    num_logits: int,
    device: torch.device | str,
    share: float = 0.8,
    narrow: int = 0,
    logits_left: Sequence[int] | None = None,
) -> Packing | None:
    """The :class:`Packing` of a (B, ``width``) grid of rows laid out as ``left`` padding,
    ``real`` tokens, then right padding, when computing only the real tokens saves enough to
    pay for gathering them (a fifth of the grid or more is padding); None otherwise.

    A forward's matmuls cost in proportion to the positions they compute: at 16 rows on the
    demo target, one row verifying 8 drafted tokens beside 15 verifying none made all 16
    compute 9 positions (24 ms a forward, 13 ms packed: ``docs/batched_engine.md``).
    ``share``: see :func:`worth_packing` (1: always pack). ``narrow``: with more than 0, the
    attention splits where :func:`attention_split` finds it pays (rows of at most ``narrow``
    columns set the tail). ``logits_left``: where each row's tokens began in the grid whose
    last ``num_logits`` columns the logits are of, when the rows were moved for attention
    (:func:`osd.decode.forward.run_model` right-aligns them); None: ``left``.
    """
    if not worth_packing(real, width, share):
        return None
    index: list[int] = []
    logits_from: list[int] = []
    logits_to: list[int] = []
    tail = width - num_logits  # first column that gives logits
    origins = left if logits_left is None else logits_left
    for b, (pad, count, origin) in enumerate(zip(left, real, origins, strict=True)):
        for offset in range(count):
            if origin + offset >= tail:
                logits_from.append(len(index))
                logits_to.append(b * num_logits + origin + offset - tail)
            index.append(b * width + pad + offset)
    found = attention_split(left, real, width, narrow) if narrow > 0 else None
    places = _split_places(index, found, len(left), width) if found else []
    columns = to_device(
        torch.tensor([index, places] if found else [index], dtype=torch.int64), device
    )
    tails = to_device(torch.tensor([logits_from, logits_to], dtype=torch.int64), device)
    split = None
    if found:
        wide = to_device(torch.tensor(found[1], dtype=torch.int64), device)
        split = AttentionSplit(found[0], wide, columns[1])
    return Packing(columns[0], tails[0], tails[1], split)


def _split_places(
    index: list[int], found: tuple[int, list[int]], rows: int, width: int
) -> list[int]:
    """Each grid index's place in an :class:`AttentionSplit`'s two grids, flattened."""
    tail, wide = found
    head = width - tail
    wide_rank = {b: r for r, b in enumerate(wide)}
    places = []
    for flat in index:
        b, column = divmod(flat, width)
        if column >= head:
            places.append(b * tail + column - head)
        else:
            places.append(rows * tail + wide_rank[b] * head + column)
    return places


def plan_one_row(
    num_tokens: int,
    trash_slot: int,
    dtype: torch.dtype,
    layout: AttentionLayout | None,
    device: torch.device | str,
) -> ForwardPlan:
    """A plan for one fresh row of ``num_tokens`` zeros in slot 0 (sizing and profiling)."""
    return plan_zero_rows([num_tokens], 0, trash_slot, dtype, layout, device)


def plan_zero_rows(
    lengths: list[int],
    start: int,
    trash_slot: int,
    dtype: torch.dtype,
    layout: AttentionLayout | None,
    device: torch.device | str,
    packed: bool = False,
    narrow: int = 0,
) -> ForwardPlan:
    """A plan for rows in slots 0.. with ``lengths[b]`` tokens (zeros: only the shapes matter)
    after ``start`` positions each, left-padded to the longest; ``packed``: only the real
    tokens computed (sizing, profiling, compiling graphs ahead), its attention split as
    :func:`packing` splits it with ``narrow``."""
    rows, width = len(lengths), max(lengths)
    left = [width - n for n in lengths]

    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return plan_forward(
        input_ids=torch.zeros(rows, width, dtype=torch.int64, device=device),
        start=column([start] * rows),
        left=column(left),
        real=column(lengths),
        own_slot=column(list(range(rows))),
        base_slot=column(list(range(rows))),
        prefix_len=column([0] * rows),
        trash_slot=trash_slot,
        dtype=dtype,
        kv_len=start + width,
        layout=layout,
        max_real=width,
        first_slot=0,
        packed=packing(left, lengths, width, 1, device, share=1.0, narrow=narrow)
        if packed
        else None,
    )


class SlotKVCache:
    """Per-slot keys and values of every layer of one model (see the module docstring).

    Passed to a Hugging Face model as its cache: the model calls :meth:`update` once per layer
    with the new keys and values, and gets back the keys and values its rows may attend to.
    Storage is allocated on first use (shapes and dtype come from the model) and grows along
    the position dimension up to ``max_len``.

    A layer whose queries reach back at most ``span`` positions (a sliding window or an
    attention chunk) keeps only a ring of ``span + max_forward - 1`` positions per slot when
    that is below ``max_len``: position p lives at p mod the ring. A forward writes at most
    ``max_forward`` positions per row, so the keys each of its queries may see (the span
    before it) are never overwritten by the same forward, and a rolled-back position is
    written again before any query sees it; older positions are masked anyway.

    Args:
        num_slots: rows of KV memory (a spectr request takes one per draft sequence).
        max_len: most positions one slot holds.
        spans: per layer, how far back its queries reach (None: every earlier position); empty:
            every layer full.
        max_forward: most tokens one row writes in one forward; None: ``max_len`` (no rings).
        whole: allocate every position at first use rather than growing: for a cache sized
            to a memory budget (that memory is the cache's anyway, as vLLM allocates its
            blocks at start). Growing zeroes and copies every layer in the middle of a step,
            and its last doubling holds 1.5x the cache at once.
    """

    is_compileable = False

    def __init__(
        self,
        num_slots: int,
        max_len: int,
        spans: Sequence[int | None] = (),
        max_forward: int | None = None,
        whole: bool = False,
    ) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"need num_slots >= 1 and max_len >= 1, got {num_slots}, {max_len}")
        if max_forward is not None and max_forward < 1:
            raise ValueError(f"max_forward must be >= 1, got {max_forward}")
        self.num_slots = num_slots
        self.max_len = max_len
        self.max_forward = max_forward or max_len
        # Positions each layer keeps per slot (a ring when below max_len).
        self.kept = kept_positions(spans, max_len, self.max_forward)
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        # Storage grows per group of layers keeping the same number of positions.
        least = max_len if whole else _MIN_CAPACITY
        self._capacity = {kept: min(least, kept) for kept in {max_len, *self.kept}}
        self._plan: ForwardPlan | None = None
        # The bound plan's reads and writes as row indices of the (slot x position) flattened
        # storage, per group: index_select/index_copy_ on them cost a fifth of 2-D indexing.
        self._read_index: dict[int, torch.Tensor] = {}
        self._write_index: dict[int, torch.Tensor] = {}
        # Times the storage was allocated or grew: a forward that grows it zeroes and copies
        # every layer's keys and values (19 of a 38 ms verify step at 16 rows on the demo
        # target), a cost of the rows' length, not of that step's kind
        # (GoodputController.observe_step).
        self.growths = 0

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    @property
    def has_rings(self) -> bool:
        """Whether some layer keeps only a window of positions (a ring that wraps)."""
        return any(kept < self.max_len for kept in self.kept)

    def _kept(self, layer_idx: int) -> int:
        return self.kept[layer_idx] if layer_idx < len(self.kept) else self.max_len

    def bind(self, plan: ForwardPlan) -> None:
        """Sets the plan the next forward follows; grows the storage if it needs more room."""
        needed = plan.kv_len  # real tokens are written below it (padding goes to the trash)
        if needed > self.max_len:
            raise ValueError(f"forward needs {needed} positions; slots hold {self.max_len}")
        if plan.max_real > self.max_forward and min(self.kept, default=self.max_len) < self.max_len:
            raise ValueError(
                f"a row writes {plan.max_real} positions in one forward; this cache's rings "
                f"take at most {self.max_forward}"
            )
        grown = {
            kept: min(_doubled(capacity, min(needed, kept)), kept)
            for kept, capacity in self._capacity.items()
            if capacity < min(needed, kept)
        }
        if grown:
            self._grow(grown)
        self._plan = plan
        positions = torch.arange(plan.kv_len, device=plan.read_slot.device)
        for kept, capacity in self._capacity.items():
            ring = kept < self.max_len  # positions wrap (else they are below capacity)
            write_pos = plan.write_pos % kept if ring else plan.write_pos
            write = (plan.write_slot * capacity + write_pos).reshape(-1)
            self._write_index[kept] = write if plan.packed is None else write[plan.packed.index]
            if not self._reads_in_place(kept):
                read_pos = positions % kept if ring else positions
                self._read_index[kept] = (plan.read_slot * capacity + read_pos).reshape(-1)

    def in_place_io(
        self, num_layers: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, int] | None:
        """Every layer's key and value storage, the bound plan's write index (its computed
        columns': every column's, or the ``packed`` ones') and its first slot, when each of
        ``num_layers`` layers reads its rows in place from full-length storage (the decode
        steady state: a compiled forward takes plain tensors, :mod:`osd.decode.
        compiled_forward`); None otherwise."""
        plan = self._plan
        if (
            plan is None
            or plan.first_slot is None
            or len(self._capacity) != 1
            or len(self._keys) != num_layers
        ):
            return None
        return self._keys, self._values, self._write_index[self.max_len], plan.first_slot

    def _reads_in_place(self, kept: int) -> bool:
        """Whether the bound plan's rows read this group's keys as a view (consecutive slots,
        and positions in order: no ring, or one that has not wrapped)."""
        plan = self._plan
        return (
            plan is not None
            and plan.first_slot is not None
            and (kept == self.max_len or plan.kv_len <= kept)
        )

    def _grow(self, grown: dict[int, int]) -> None:
        # All new tensors first: a failed allocation leaves every layer as it was.
        news = [
            [
                old.new_zeros((old.shape[0], grown[self._kept(i)], *old.shape[2:]))
                if self._kept(i) in grown
                else old
                for i, old in enumerate(store)
            ]
            for store in (self._keys, self._values)
        ]
        for store, layers in zip((self._keys, self._values), news, strict=True):
            for i, new in enumerate(layers):
                if new is not store[i]:
                    new[:, : store[i].shape[1]] = store[i]
                    store[i] = new
        self._capacity.update(grown)
        self.growths += 1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes (B, H, T, D) keys/values per the plan; returns (B, H, S, D) readable ones
        (keys and values may have heads of different sizes: multi-head latent attention's)."""
        assert self._plan is not None and self._plan.packed is None, "a plan of every column"
        keys, values = (s.transpose(1, 2).flatten(0, 1) for s in (key_states, value_states))
        return self.update_packed(keys, values, layer_idx)

    def update_packed(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes (N, H, D) keys/values, one per computed column of the plan (every column in
        row-major order, or the plan's ``packed`` ones); returns (B, H, S, D) readable ones."""
        plan = self._plan
        assert plan is not None, "bind() a plan before the forward"
        kept = self._kept(layer_idx)
        if layer_idx == len(self._keys):
            rows = (self.num_slots + 1, self._capacity[kept])
            self._keys.append(key_states.new_zeros((*rows, *key_states.shape[1:])))
            self._values.append(value_states.new_zeros((*rows, *value_states.shape[1:])))
            self.growths += layer_idx == 0  # first allocated: that step zeroed it all
        batch = plan.read_slot.shape[0]
        # Rows in consecutive slots read their keys in place (a strided view), unless this
        # layer's ring has wrapped (positions no longer in order).
        first = plan.first_slot
        in_place = self._reads_in_place(kept)
        out = []
        for store, new in (
            (self._keys[layer_idx], key_states),
            (self._values[layer_idx], value_states),
        ):
            flat = store.view(-1, *new.shape[1:])  # (slots * capacity, H, D)
            flat.index_copy_(0, self._write_index[kept], new)
            if in_place and first is not None:
                read = store[first : first + batch, : plan.kv_len]  # (B, S, H, D), a view
            else:
                read = flat.index_select(0, self._read_index[kept]).view(
                    batch, plan.kv_len, *new.shape[1:]
                )
            out.append(read.transpose(1, 2))
        return out[0], out[1]

    def copy_positions(self, src: torch.Tensor, dst: torch.Tensor, pos: torch.Tensor) -> None:
        """Copies position ``pos[i]`` of slot ``src[i]`` to slot ``dst[i]``, in every layer.

        Args:
            src, dst, pos: (N,) int64; e.g. a chosen SpecTr branch's kept tokens moving into
                its request's slot.
        """
        if pos.numel() == 0:
            return
        for i, store in enumerate((*self._keys, *self._values)):
            kept = self._kept(i % len(self._keys))
            capacity = self._capacity[kept]
            flat = store.view(-1, *store.shape[2:])
            at = pos % kept
            flat.index_copy_(0, dst * capacity + at, flat[src * capacity + at])

    def bytes_per_layer_position(self) -> list[int]:
        """Bytes one position of one slot takes in each layer's keys and values (empty before
        the first forward, which sizes the storage)."""
        return [
            k.element_size() * k[0, 0].numel() + v.element_size() * v[0, 0].numel()
            for k, v in zip(self._keys, self._values, strict=True)
        ]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Unused with explicit position ids; present for models that ask."""
        return 0


def kept_positions(spans: Sequence[int | None], max_len: int, max_forward: int) -> list[int]:
    """Positions each layer keeps per slot: ``max_len``, or its span and one forward's tokens
    (a ring) when that is less (:class:`SlotKVCache`)."""
    return [max_len if span is None else min(max_len, span + max_forward - 1) for span in spans]


def _doubled(capacity: int, needed: int) -> int:
    """``capacity`` doubled until it holds ``needed`` (which is within the layer's limit)."""
    while capacity < needed:
        capacity *= 2
    return capacity
