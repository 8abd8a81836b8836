"""Versions of each draft adapter loaded in one replica, swapped without dropping requests.

Every loaded version is its own peft adapter named ``<adapter>@<version>``. A request leases the
current version when it starts and keeps it to the end, so a swap never changes the draft under
a running request (and verification keeps outputs exact whatever the draft). The previous
version and version 0 (the base draft) stay loaded for rollback; others are deleted once no
request uses them.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["AdapterLease", "AdapterSlots", "ReadWriteLock", "peft_adapter_name"]


def peft_adapter_name(adapter: str, version: int) -> str:
    return f"{adapter}@{version}"


@dataclass(frozen=True)
class AdapterLease:
    """A version of an adapter held by one request."""

    adapter: str
    version: int

    @property
    def peft_name(self) -> str:
        return peft_adapter_name(self.adapter, self.version)


class ReadWriteLock:
    """Many readers (decode forwards) or one writer (adding or deleting an adapter)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            self._cond.wait_for(lambda: self._readers == 0)
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class AdapterSlots:
    """Current and previous version per adapter, with leases; thread-safe.

    Args:
        model: the peft draft; adapters ``<name>@0`` must already be attached.
        adapters: logical adapter names.
    """

    def __init__(self, model: Any, adapters: list[str]) -> None:
        self.model = model
        self._current = {name: 0 for name in adapters}
        self._previous: dict[str, int | None] = {name: None for name in adapters}
        self._leases: Counter[str] = Counter()
        self._installing: set[str] = set()  # loaded but not yet current: never collected
        self._lock = threading.Lock()
        # Decode forwards read the adapters' module dicts; installs and deletes write them.
        self.model_lock = ReadWriteLock()

    @property
    def adapters(self) -> list[str]:
        return list(self._current)

    def current(self, adapter: str) -> int:
        return self._current[adapter]

    def previous(self, adapter: str) -> int | None:
        return self._previous[adapter]

    def leased(self) -> dict[str, int]:
        """Loaded versions (peft names, e.g. ``code@3``) with requests using them now, and how
        many: empty when no request holds a lease (a leak shows here)."""
        with self._lock:
            return {name: count for name, count in self._leases.items() if count}

    def acquire(self, adapter: str) -> AdapterLease:
        with self._lock:
            lease = AdapterLease(adapter, self._current[adapter])
            self._leases[lease.peft_name] += 1
        return lease

    def release(self, lease: AdapterLease) -> bool:
        """Ends a lease; True if its version is now unused. Unloading it (:meth:`collect`)
        waits for the forwards in progress, so a server calls it off its event loop."""
        with self._lock:
            self._leases[lease.peft_name] -= 1
            return lease.peft_name in self._unused()

    def collect(self) -> None:
        """Unloads loaded versions that are neither current, previous, version 0 nor leased.

        Never waits for the forwards in progress while holding the slots' lock (which
        `acquire` and `release` take on a server's event loop): it looks first, then takes
        the model's write lock, then decides again under both.
        """
        with self._lock:
            if not self._unused():
                return
        with self.model_lock.writing(), self._lock:
            for name in self._unused():
                self.model.delete_adapter(name)
                self._leases.pop(name, None)

    def swap_in(
        self,
        adapter: str,
        version: int,
        install: Callable[[Any, str], None],
        *,
        keep_previous: bool = False,
    ) -> None:
        """Loads ``version`` (``install(model, peft_name)``, off the decode path), makes it
        current and keeps the old current as previous (with ``keep_previous``, the previous
        stays and the old current is dropped: it was never proven, so it is no baseline; an
        older ``version`` leaves no previous)."""
        name = peft_adapter_name(adapter, version)
        with self._lock:
            self._installing.add(name)
        try:
            with self.model_lock.writing():
                if name not in self.model.peft_config:
                    install(self.model, name)
            with self._lock:
                current = self._current[adapter]
                if version < current:
                    # The pointer moved back (versions only grow): a rollback elsewhere. What
                    # it replaces was judged worse, so it is no baseline.
                    self._previous[adapter] = None
                elif version > current and not (
                    keep_previous and self._previous[adapter] is not None
                ):
                    self._previous[adapter] = current
                self._current[adapter] = version
        finally:
            with self._lock:
                self._installing.discard(name)
            self.collect()

    def roll_back(self, adapter: str, to_version: int | None = None) -> int | None:
        """Makes the previous (or the given loaded) version current again, with no previous
        version (what it replaces was judged worse, or the pointer moved back); returns it."""
        with self._lock:
            target = self._previous[adapter] if to_version is None else to_version
            if target is None or peft_adapter_name(adapter, target) not in self.model.peft_config:
                return None
            self._previous[adapter], self._current[adapter] = None, target
        self.collect()
        return target

    def _unused(self) -> list[str]:
        """Loaded versions that are neither current, previous, version 0, installing nor
        leased (call with ``self._lock`` held)."""
        # Version 0, the base draft (an identity adapter), stays for rollbacks to it.
        keep = {peft_adapter_name(a, v) for a in self._current for v in (0, self._current[a])}
        keep |= {peft_adapter_name(a, v) for a, v in self._previous.items() if v is not None}
        keep |= self._installing
        return [
            name
            for name in list(self.model.peft_config)  # one atomic copy under the GIL
            if name not in keep and self._leases[name] <= 0 and "@" in name
        ]
