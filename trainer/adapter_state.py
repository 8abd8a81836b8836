"""One adapter's bookkeeping in the trainer worker, in one object.

Its record windows (:class:`trainer.replay.AdapterData`: the judge's hold-out, fresh records,
replay), the store version its weights descend from (what the next publish expects the pointer
to name), whether it ran a round in this process (an adapter with no version starts from the
best published one at its first round), and the arrival times of the records it trained on
since its last published version (the record-to-version latency). Its current and candidate
weights are two peft adapters of the draft trainer's one model (``<name>@candidate``,
``<name>@current``: `trainer.draft_trainer.peft_name`), since a training step and a judge's
forward run through that model.

:func:`adapter_states` builds them for :func:`trainer.wiring.wire_trainer`, which hands the same
objects to the publisher (versions) and the worker (windows, rounds); the routing trainer reads
the versions through :class:`AdapterVersions`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from osd.config import TrainerConfig
from trainer.examples import example_window
from trainer.replay import AdapterData

__all__ = ["AdapterState", "AdapterVersions", "adapter_states"]


@dataclass
class AdapterState:
    """One adapter's windows, version and bookkeeping."""

    name: str
    data: AdapterData
    version: int | None = None  # the store version its weights descend from (None: none yet)
    started: bool = False  # ran a round in this process
    unpublished: list[float] = field(default_factory=list)  # arrival times since its version

    def published(self) -> list[float]:
        """The arrival times of the records its new version learned from; forgets them."""
        arrived, self.unpublished = self.unpublished, []
        return arrived


def adapter_states(cfg: TrainerConfig, adapters: list[str]) -> dict[str, AdapterState]:
    """A fresh state per adapter, its windows sized by `cfg` (`trainer.*`)."""
    key = functools.partial(example_window, adapter_names=tuple(adapters))
    return {
        a: AdapterState(
            a,
            AdapterData(
                cfg.replay_size,
                cfg.holdout_size,
                cfg.max_domains,
                key,
                holdout_fraction=cfg.holdout_fraction,
                min_holdout=cfg.min_holdout_records,
            ),
        )
        for a in adapters
    }


class AdapterVersions(Mapping[str, int | None]):
    """Adapter name -> the version its weights descend from: a live, read-only view of
    `states`, for readers that need only versions (the routing trainer, the actor's status)."""

    def __init__(self, states: Mapping[str, AdapterState]) -> None:
        self._states = states

    def __getitem__(self, adapter: str) -> int | None:
        return self._states[adapter].version

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)
