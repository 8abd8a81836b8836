"""One adapter's bookkeeping in the trainer worker, in one object.

Its record windows (:class:`trainer.replay.AdapterData`: the judge's hold-out, fresh records,
replay), whether it ran a round in this process (an adapter with no version starts from the
best published one at its first round), and the arrival times of the records it trained on
since its last published version (the record-to-version latency). Its versions are the
publisher's (``Publisher.versions``), its current and candidate weights the draft trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.replay import AdapterData

__all__ = ["AdapterState"]


@dataclass
class AdapterState:
    """One adapter's windows and bookkeeping."""

    name: str
    data: AdapterData
    started: bool = False  # ran a round in this process
    unpublished: list[float] = field(default_factory=list)  # arrival times since its version

    def published(self) -> list[float]:
        """The arrival times of the records its new version learned from; forgets them."""
        arrived, self.unpublished = self.unpublished, []
        return arrived
