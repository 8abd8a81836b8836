"""Per-adapter data: the judge's windows, fresh records, the bounded replay window, and which
stream entries may be acknowledged.

Pure (the standard library and numpy): the worker feeds records in and takes batches out.

**Test, then train** (prequential): every record an adapter receives first joins its domain's
**hold-out window**, the records the judge estimates candidates on; the window keeps the newest
ones, and a record it pushes out becomes **fresh**, to be trained on. So the judge only ever sees
records the candidate never trained on, and no record is withheld from training for good (only the
newest few of each domain wait, until newer ones push them out). A window holds
`holdout_fraction` of the records its domain has sent, at least `min_holdout` and at most
`holdout_size`: a new domain's first `2 * min_holdout` records are enough to train a first
candidate on half and judge it on the other half, and a busy domain's judge sees more.

Each training step of an adapter takes about half its batch from fresh records (oldest first) and
the rest from its **replay window** (the last `replay_size` records it trained on *per domain*), so
an adapter follows the traffic without lag yet keeps seeing what it learnt before. A fresh record
joins the replay window once a step has used it. When the window is short, more fresh records fill
the batch; when no fresh record is left, steps replay only.

Windows are kept per domain (`DomainWindows`) and replay draws the domains in equal shares: the
general adapter learns from every domain, and a flood of one domain (code after prose) must
neither push the others out of its memory nor out of its judge's sight, or it would forget them.
Domain labels come from requests, so the worker keys windows by the configured domain adapters
plus one bucket for every other label (`trainer.examples.window_key`): a client inventing labels
cannot push the real domains out. At most `max_domains` windows are kept; the one fed least
recently is dropped first (a dropped hold-out window's records become fresh).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from trainer.examples import Example

__all__ = ["AckTracker", "AdapterData", "DomainWindows", "held_for_judging"]

T = TypeVar("T")  # what a window holds: an `Example`, or the content router's samples of one


def record_domain(example: Example) -> str:
    """The window an example goes to by default: its record's domain label."""
    return example.record.domain


class DomainWindows(Generic[T]):
    """The newest `size` examples of each domain, for at most `max_domains` domains.

    Iterating yields every kept example, domain by domain, oldest first within a domain.
    `key` names an example's window (default: its record's domain label). `append` may keep a
    window at another size than `size` (the hold-out windows grow with their domain's traffic).
    """

    def __init__(
        self, size: int, max_domains: int, key: Callable[[Any], str] = record_domain
    ) -> None:
        if size < 1 or max_domains < 1:
            raise ValueError(f"size and max_domains must be >= 1, got {size}, {max_domains}")
        self.size, self.max_domains, self.key = size, max_domains, key
        self._windows: OrderedDict[str, deque[T]] = OrderedDict()  # least recently fed first

    def append(self, example: T, size: int | None = None) -> list[T]:
        """Adds `example` to its domain's window, which then keeps its newest `size` (default:
        the windows' size) examples.

        Returns:
            The examples that left: the window's oldest beyond `size`, and all of the least
            recently fed domain's when a new domain needs its place.
        """
        size = self.size if size is None else size
        domain, left = self.key(example), list[T]()
        window = self._windows.get(domain)
        if window is None:
            if len(self._windows) >= self.max_domains:
                left.extend(self._windows.popitem(last=False)[1])
            window = self._windows[domain] = deque()
        else:
            self._windows.move_to_end(domain)
        window.append(example)
        while len(window) > size:
            left.append(window.popleft())
        return left

    def extend(self, examples: Iterable[T]) -> None:
        for example in examples:
            self.append(example)

    def __len__(self) -> int:
        return sum(len(w) for w in self._windows.values())

    def __iter__(self) -> Iterator[T]:
        for window in self._windows.values():
            yield from window

    def by_domain(self) -> dict[str, list[T]]:
        """Domain -> its kept examples, oldest first."""
        return {domain: list(window) for domain, window in self._windows.items()}

    def sample(self, count: int, rng: np.random.Generator) -> list[T]:
        """Up to `count` distinct examples, the domains in equal shares as far as they last."""
        windows = [w for w in self._windows.values() if w]
        pools = [[int(i) for i in rng.permutation(len(w))] for w in windows]
        order = [int(i) for i in rng.permutation(len(windows))]
        picks: list[T] = []
        while len(picks) < count and any(pools):
            for d in order:
                if pools[d] and len(picks) < count:
                    picks.append(windows[d][pools[d].pop()])
        return picks


class AdapterData:
    """The records one adapter trains and is judged on.

    Args:
        replay_size: records kept in the replay window, per domain (>= 1).
        holdout_size: the most records a hold-out window keeps, per domain (>= 1).
        max_domains: domains kept in each window (>= 1).
        key: which domain window an example goes to (default: its record's domain label).
        holdout_fraction: the share of its domain's records a hold-out window keeps, in [0, 1).
        min_holdout: the fewest records a hold-out window keeps (capped by `holdout_size`).
    """

    def __init__(
        self,
        replay_size: int,
        holdout_size: int,
        max_domains: int = 8,
        key: Callable[[Example], str] = record_domain,
        *,
        holdout_fraction: float = 0.2,
        min_holdout: int = 8,
    ) -> None:
        if replay_size < 1 or holdout_size < 1:
            raise ValueError(
                f"replay_size and holdout_size must be >= 1, got {replay_size}, {holdout_size}"
            )
        if not 0.0 <= holdout_fraction < 1.0 or min_holdout < 0:
            raise ValueError(
                f"need holdout_fraction in [0, 1) and min_holdout >= 0, got {holdout_fraction}, "
                f"{min_holdout}"
            )
        self.fresh: deque[Example] = deque()
        self.replay = DomainWindows[Example](replay_size, max_domains, key)
        self.holdout = DomainWindows[Example](holdout_size, max_domains, key)
        self.holdout_fraction, self.min_holdout = holdout_fraction, min(min_holdout, holdout_size)
        self._seen: Counter[str] = Counter()  # records received per hold-out window

    def holdout_target(self, domain: str) -> int:
        """How many records `domain`'s hold-out window keeps now."""
        share = int(self._seen[domain] * self.holdout_fraction)
        return min(self.holdout.size, max(self.min_holdout, share))

    def add(self, example: Example) -> list[Example]:
        """Test, then train: `example` joins its domain's hold-out window, and the records that
        window no longer keeps become fresh.

        Returns:
            The records that became fresh.
        """
        domain = self.holdout.key(example)
        self._seen[domain] += 1
        released = self.holdout.append(example, self.holdout_target(domain))
        self.fresh.extend(released)
        return released

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
        return fresh + self.replay.sample(num_replay, rng), fresh

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

    def __contains__(self, entry_id: object) -> bool:
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

    def expect_more(self, entry_id: str) -> None:
        """One more adapter will train on a registered entry (a new topic took it)."""
        self._remaining[entry_id] += 1

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


def held_for_judging(acks: AckTracker, data: Iterable[AdapterData]) -> int:
    """How many unacknowledged entries wait only in judge windows (in no adapter's fresh queue):
    pending by design, not a backlog (the trainer's heartbeat reports them)."""
    fresh = {e.entry_id for adapter_data in data for e in adapter_data.fresh if e.entry_id in acks}
    return len(acks) - len(fresh)
