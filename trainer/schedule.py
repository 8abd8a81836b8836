"""Which adapter trains next: pure rules over the adapters' data (no models, no I/O).

A round goes to the ready adapter that stands to gain most (`expected_gain`): the records it
has not trained on yet, weighted by how often the replicas' draft was wrong on them, as logged.
So a new domain served by a draft that knows nothing of it (acceptance near 0) goes before a
general adapter whose records the draft already gets mostly right, however many each has.
An adapter with no version yet is ready sooner (`first_version_due`), and the worker puts it
first: its first version is worth more than a full round's worth of records.
"""

from __future__ import annotations

from collections.abc import Iterable

from trainer.examples import Example
from trainer.replay import AdapterData

__all__ = ["expected_gain", "first_version_due"]

# The least room to improve a round is credited with: records the draft got all right still
# teach something (and keep the replay current), so their adapter is not starved for good.
MIN_ROOM = 1e-3


def expected_gain(fresh: Iterable[Example]) -> float:
    """Fresh records times the share of their drafted tokens the draft got wrong (1 when none
    was drafted, e.g. requests served with speculation off: nothing says the draft was right).
    Only the draft model's steps count: looked-up drafts say nothing of the draft."""
    count = drafted = accepted = 0
    for example in fresh:
        count += 1
        model = example.record.model_steps
        drafted += int(example.record.num_drafted[model].sum())
        accepted += int(example.record.num_accepted[model].sum())
    room = 1.0 - accepted / drafted if drafted else 1.0
    return count * max(room, MIN_ROOM)


def first_version_due(version: int | None, data: AdapterData, least: int) -> bool:
    """Whether an adapter with no published version (`version` None) has enough records for a
    first round: `least` fresh ones to train on and `least` held out to judge on."""
    return version is None and len(data.fresh) >= least and len(data.holdout) >= least
