"""From logged records to training batches: routing, hold-out, positions, padding.

Pure (numpy and torch only): no Redis, no models, no clocks. The worker (`trainer.worker`) calls
these on the records it reads; tests call them on hand-made records.

Vocabulary of this module:

- a **generated position** `g` of a record is the `g`-th generated token; the target's logged
  top-m distribution at `g` is what the draft should have predicted from the context
  `token_ids[: prompt_len + g]`, i.e. from the draft's logits at input index `prompt_len + g - 1`;
- a **rejected position** is the one right after the accepted prefix of a step whose drafted
  tokens were not all accepted: the position where the draft was wrong and the target's residual
  (recovered) token was emitted instead. OSD (Liu et al. 2023, arXiv 2310.07177) trains on those;
  `positions="all"` trains on every generated position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from osd.buffer.record import Record

__all__ = [
    "Batch",
    "Example",
    "PositionMode",
    "adapters_for",
    "collate",
    "entry_time",
    "example_window",
    "is_held_out",
    "rejected_positions",
    "train_positions",
    "window_key",
]

PositionMode = Literal["all", "rejected"]


def is_held_out(request_id: str, fraction: float) -> bool:
    """Whether a record belongs to the judge's hold-out set, never to training.

    Decided by a hash of `request_id` alone (blake2b, not Python's salted `hash`), so every
    trainer process, before and after a restart, puts a record on the same side.

    Raises:
        ValueError: `fraction` outside [0, 1).
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"holdout fraction must be in [0, 1), got {fraction}")
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


def window_key(record: Record, adapter_names: Sequence[str], domain: str | None = None) -> str:
    """The replay and hold-out window a record belongs to: its domain (`domain` when given,
    else its label) when that domain has its own adapter, else ``""``, one bucket for every other
    label (prose in the demo, and any label a client made up), so requests cannot multiply the
    windows."""
    domain = record.domain if domain is None else domain
    return domain if domain in adapter_names[1:] else ""


def adapters_for(
    record: Record, adapter_names: Sequence[str], domain: str | None = None
) -> list[str]:
    """The adapters that learn from `record`.

    The first configured adapter is the general one and learns from every record; each other
    adapter is a per-domain adapter named after its domain and learns from the records whose
    `domain` equals its name. Which adapter served the request (`record.adapter_name`) does not
    matter: the target's distribution is the label whatever draft proposed the tokens.

    Args:
        record: a logged record.
        adapter_names: `config.model.adapters`, general adapter first.
        domain: the domain an unlabeled record was assigned to (`trainer.topics`); None: the
            record's own label.

    Returns:
        Adapter names, general first; a record of an unknown domain goes to the general one only.
    """
    if not adapter_names:
        raise ValueError("adapter_names must name at least the general adapter")
    general, *domains = adapter_names
    domain = record.domain if domain is None else domain
    return [general, domain] if domain in domains else [general]


def rejected_positions(record: Record) -> npt.NDArray[np.int64]:
    """Generated positions where a drafted token was rejected, one per step at most.

    Step `s` emits its `num_accepted[s]` accepted tokens and then one more; if it accepted fewer
    than it drafted, that one more (at generated position `offset_s + num_accepted[s]`) is where
    the draft was wrong. A step that accepted everything ended in a bonus token instead, not a
    rejection. Positions cut off by a stop token or the length budget are left out, and so are
    steps a model-free proposer drafted (a looked-up token rejected says nothing of the draft).

    Returns:
        (R,) ascending int64 generated positions, R <= number of steps.
    """
    accepted = record.num_accepted.astype(np.int64)  # (S,)
    drafted = record.num_drafted.astype(np.int64)  # (S,)
    offsets = np.concatenate([[0], np.cumsum(accepted + 1)[:-1]])  # (S,) first position of step
    positions = offsets + accepted
    keep = (accepted < drafted) & (positions < record.num_generated) & record.model_steps
    return positions[keep]


def train_positions(record: Record, mode: PositionMode) -> npt.NDArray[np.bool_]:
    """(G,) bool: the generated positions of `record` that the loss counts under `mode`."""
    if mode == "all":
        return np.ones(record.num_generated, dtype=np.bool_)
    if mode == "rejected":
        mask = np.zeros(record.num_generated, dtype=np.bool_)
        mask[rejected_positions(record)] = True
        return mask
    raise ValueError(f"positions must be 'all' or 'rejected', got {mode!r}")


def entry_time(entry_id: str) -> float:
    """Unix seconds from a stream entry id (``<ms>-<seq>``); 0 when it is not one."""
    head = entry_id.partition("-")[0]
    return int(head) / 1e3 if head.isdigit() else 0.0


@dataclass(frozen=True)
class Example:
    """One record as training or hold-out data.

    Attributes:
        entry_id: the log stream entry id it came from ("" when not from a stream).
        record: the record itself.
        arrived_at: unix seconds when it reached the log (from the entry id), for latency.
        domain: the domain it trains as when its record carries no label (a topic's adapter,
            `trainer.topics`); None: its record's label decides.
    """

    entry_id: str
    record: Record
    arrived_at: float
    domain: str | None = None

    @property
    def num_generated(self) -> int:
        return self.record.num_generated


@dataclass(frozen=True)
class Batch:
    """Right-padded draft inputs with the logged target distribution aligned to them.

    Shapes: B records, L = longest `len(token_ids) - 1`, m = the smallest top-m in the batch.
    Index `t` of the inputs predicts token `t + 1`; only indices `>= first_index` have logits
    computed (the shared prompt prefix needs none).

    Attributes:
        input_ids: (B, L) int64 token ids, 0 past each record's end.
        attention_mask: (B, L) int64, 1 on real tokens.
        target_top_ids: (B, L, m) int64 logged ids at generated positions, 0 elsewhere.
        target_top_probs: (B, L, m) float32 their probabilities, 0 elsewhere.
        train_mask: (B, L) bool, positions the loss counts.
        eval_mask: (B, L) bool, every generated position (what acceptance is judged on).
        first_index: first input index with a generated position in any record.
    """

    input_ids: Tensor
    attention_mask: Tensor
    target_top_ids: Tensor
    target_top_probs: Tensor
    train_mask: Tensor
    eval_mask: Tensor
    first_index: int

    @property
    def num_train_positions(self) -> int:
        return int(self.train_mask.sum())

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) input tokens: the draft's forward work."""
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        """A copy with every tensor on `device`."""
        return Batch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            target_top_ids=self.target_top_ids.to(device),
            target_top_probs=self.target_top_probs.to(device),
            train_mask=self.train_mask.to(device),
            eval_mask=self.eval_mask.to(device),
            first_index=self.first_index,
        )

    def sliced(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`(target_top_ids, target_top_probs, train_mask, eval_mask)` from `first_index` on,
        aligned with logits computed for the last `L - first_index` inputs."""
        i = self.first_index
        return (
            self.target_top_ids[:, i:],
            self.target_top_probs[:, i:],
            self.train_mask[:, i:],
            self.eval_mask[:, i:],
        )


def collate(records: Sequence[Record], mode: PositionMode) -> Batch:
    """Pads records into one `Batch`, marking the positions `mode` trains on.

    A record's top-m lists are cut to the smallest m in the batch (the logged ids are sorted by
    probability, so this keeps each record's most likely ones); the cut mass joins the tail bucket
    of the losses, which stays a valid coarsening.

    Raises:
        ValueError: no records, or a record without prompt or generated tokens.
    """
    if not records:
        raise ValueError("cannot collate an empty list of records")
    for record in records:
        if record.prompt_len < 1 or record.num_generated < 1:
            raise ValueError(
                f"record {record.request_id!r} needs a prompt and generated tokens, got "
                f"prompt_len={record.prompt_len} num_generated={record.num_generated}"
            )
    batch, length = len(records), max(len(r.token_ids) - 1 for r in records)
    top_m = min(r.top_m for r in records)
    input_ids = np.zeros((batch, length), dtype=np.int64)
    attention = np.zeros((batch, length), dtype=np.int64)
    top_ids = np.zeros((batch, length, top_m), dtype=np.int64)
    top_probs = np.zeros((batch, length, top_m), dtype=np.float32)
    train_mask = np.zeros((batch, length), dtype=np.bool_)
    eval_mask = np.zeros((batch, length), dtype=np.bool_)
    for row, record in enumerate(records):
        num_inputs, start = len(record.token_ids) - 1, record.prompt_len - 1
        input_ids[row, :num_inputs] = record.token_ids[:-1]
        attention[row, :num_inputs] = 1
        generated = slice(start, start + record.num_generated)  # inputs predicting generated
        top_ids[row, generated] = record.target_top_ids[:, :top_m]
        top_probs[row, generated] = record.target_top_probs[:, :top_m]
        eval_mask[row, generated] = True
        train_mask[row, generated] = train_positions(record, mode)
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        target_top_ids=torch.from_numpy(top_ids),
        target_top_probs=torch.from_numpy(top_probs),
        train_mask=torch.from_numpy(train_mask),
        eval_mask=torch.from_numpy(eval_mask),
        first_index=min(r.prompt_len for r in records) - 1,
    )


def example_window(example: Example, adapter_names: Sequence[str]) -> str:
    """The replay and hold-out window of an example: its record's `window_key` (under the domain
    it was assigned to, if any)."""
    return window_key(example.record, adapter_names, example.domain)
