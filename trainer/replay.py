"""Per-adapter data: fresh records, the bounded replay window, the hold-out window, and which
stream entries may be acknowledged.

Pure (the standard library and numpy): the worker feeds records in and takes batches out.

Each training step of an adapter takes about half its batch from **fresh** records (read, never
trained on, oldest first) and the rest sampled uniformly from its **replay window** (the last
`replay_size` records it trained on), so an adapter follows the traffic without lag yet keeps
seeing what it learnt before. A fresh record joins the window once a step has used it. When the
window is short, more fresh records fill the batch; when no fresh record is left, steps replay
only. The **hold-out window** keeps the last `holdout_size` held-out records; the judge
estimates acceptance on them and they are never trained on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from trainer.examples import Example

__all__ = ["AckTracker", "AdapterData"]


class AdapterData:
    """The records one adapter trains and is judged on.

    Args:
        replay_size: records kept in the replay window (>= 1).
        holdout_size: records kept in the hold-out window (>= 1).
    """

    def __init__(self, replay_size: int, holdout_size: int) -> None:
        if replay_size < 1 or holdout_size < 1:
            raise ValueError(
                f"replay_size and holdout_size must be >= 1, got {replay_size}, {holdout_size}"
            )
        self.fresh: deque[Example] = deque()
        self.replay: deque[Example] = deque(maxlen=replay_size)
        self.holdout: deque[Example] = deque(maxlen=holdout_size)

    def add_fresh(self, example: Example) -> None:
        self.fresh.append(example)

    def add_holdout(self, example: Example) -> None:
        self.holdout.append(example)

    def oldest_fresh_at(self) -> float | None:
        """Arrival time of the oldest fresh record, or None when there is none."""
        return self.fresh[0].arrived_at if self.fresh else None

    def next_batch(
        self, batch_records: int, rng: np.random.Generator
    ) -> tuple[list[Example], list[Example]]:
        """Takes the next training batch: up to half fresh, the rest replayed.

        Fresh records taken here leave `fresh`; call `trained` with them after the step.

        Args:
            batch_records: batch size in records (>= 1).
            rng: draws the replayed records.

        Returns:
            `(batch, fresh_taken)`; the batch is empty when there is nothing to train on.
        """
        if batch_records < 1:
            raise ValueError(f"batch_records must be >= 1, got {batch_records}")
        num_fresh = min(len(self.fresh), max(1, batch_records // 2))
        num_replay = min(len(self.replay), batch_records - num_fresh)
        num_fresh = min(len(self.fresh), batch_records - num_replay)  # fill a short window
        fresh = [self.fresh.popleft() for _ in range(num_fresh)]
        picks = rng.choice(len(self.replay), size=num_replay, replace=False)  # (num_replay,)
        replayed = [self.replay[int(i)] for i in picks]
        return fresh + replayed, fresh

    def trained(self, fresh: Iterable[Example]) -> None:
        """Moves fresh records a step has used into the replay window."""
        self.replay.extend(fresh)

    def requeue(self, fresh: Sequence[Example]) -> None:
        """Puts fresh records back in front (the step using them failed)."""
        self.fresh.extendleft(reversed(fresh))


class AckTracker:
    """Counts, per stream entry, the adapters that still have to train on it.

    An entry may be acknowledged once every adapter it was routed to has used it in a training
    step (its effect is then in the adapters' weights, and the record in their replay windows),
    or at once when it is held out or skipped.
    """

    def __init__(self) -> None:
        self._remaining: dict[str, int] = {}

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self._remaining

    def __len__(self) -> int:
        return len(self._remaining)

    def expect(self, entry_id: str, num_adapters: int) -> None:
        """Registers an entry that `num_adapters` adapters will train on."""
        if num_adapters < 1:
            raise ValueError(f"num_adapters must be >= 1, got {num_adapters}")
        if entry_id in self._remaining:
            raise ValueError(f"entry {entry_id} is registered already")
        self._remaining[entry_id] = num_adapters

    def used(self, entry_ids: Iterable[str]) -> list[str]:
        """One adapter trained on `entry_ids`; returns those now done (to acknowledge)."""
        done = []
        for entry_id in entry_ids:
            if not entry_id:
                continue
            left = self._remaining[entry_id] - 1
            if left:
                self._remaining[entry_id] = left
            else:
                del self._remaining[entry_id]
                done.append(entry_id)
        return done
