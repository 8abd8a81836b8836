"""Per-replica version watcher: follows a versioned store's pointers and rolls back losers.

One watcher for every artefact a replica follows (`osd.versions`): the draft adapters
(`serving.adapter_holder.AdapterHolder`) and the content router's model
(`serving.router_trial.RouterTrial`). A background thread listens for pointer moves and also
reconciles with the pointers periodically (notifications can be lost). A new version is fetched
and checked by the store's codec off the decode path and handed to the holder, which swaps it in
for new requests; a refused version is counted and serving continues on the current one; a
version that only the store cannot give now (an outage) is fetched again later.

What differs between artefacts is the holder, and above all its acceptance rule (`Holder.verdict`):
the adapters compare each version's live acceptance with its predecessor's over a window; the
router runs a trial on the same traffic. A verdict of "rollback" moves the store's pointer back
with compare-and-set (another replica or the trainer may have moved it first: fine), refuses
the loser on this replica for good, and tells the holder.

Each reconciliation also reports the versions the holder keeps (the current one and the one it
may roll back to) to the store, with a TTL of a few intervals, so the store's garbage collection
never deletes a version a replica may return to (`VersionedStore.report_held`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from osd.threads import single_threaded_torch
from osd.versions.errors import (
    BASE_VERSION,
    PointerEvent,
    PublishConflict,
    StoreError,
    StoreUnavailable,
)
from osd.versions.retention import make_replica_id
from osd.versions.store import VersionedStore

__all__ = ["Holder", "Verdict", "VersionWatcher", "refusal_reason"]

logger = logging.getLogger(__name__)

# A held-versions report outlives this many reconcile intervals (at least HELD_TTL_MIN_S), so a
# slow load or a Redis hiccup does not let the versions it names go.
HELD_TTL_INTERVALS = 10
HELD_TTL_MIN_S = 10.0


def refusal_reason(exc: Exception) -> str:
    """The `reason` label of osd_adapter_refusals_total: what the store's check found
    (`osd.versions.errors.RefusalReason`), or the exception's type name for anything else."""
    return str(getattr(exc, "reason", None) or type(exc).__name__)


@dataclass(frozen=True)
class Verdict:
    """What a holder's acceptance rule decided about a name's current version.

    Attributes:
        outcome: "kept" (proven: the holder already stopped comparing) or "rollback".
        to_version: with "rollback", the version to go back to (may be `BASE_VERSION`).
        details: for the event (the rates compared).
    """

    outcome: str
    to_version: int = BASE_VERSION
    details: dict[str, Any] = field(default_factory=dict)


class Holder(Protocol):
    """What keeps a replica's loaded versions of one artefact, and judges them."""

    @property
    def names(self) -> Sequence[str]:
        """The artefact's names it serves (adapters; the routing model's one name)."""
        ...

    @property
    def label(self) -> str | None:
        """What events call the artefact instead of its name (None: the name)."""
        ...

    def current(self, name: str) -> int | None:
        """The version serving now (None: none yet)."""
        ...

    def held(self, name: str) -> list[int]:
        """The versions it may serve again (current, and what it may roll back to)."""
        ...

    def expected(self, name: str) -> dict[str, Any]:
        """What the store's codec checks on load (see the codec's `decode`)."""
        ...

    def install(self, name: str, version: int, manifest: Any, artefact: Any) -> dict[str, Any]:
        """Serves `version` for new requests (`artefact` None for `BASE_VERSION`); returns the
        event's details. Raises ValueError or OSError for a version it refuses."""
        ...

    def verdict(self, name: str) -> Verdict | None:
        """The acceptance rule: None while undecided (or nothing to judge)."""
        ...

    def roll_back(self, name: str, to_version: int) -> None:
        """Serves `to_version` (held, so never loaded again) instead of the current one."""
        ...

    def count(self, event: str, name: str, reason: str | None = None) -> None:
        """Counts a "swap", "refused" or "rollback" in the replica's metrics."""
        ...


class VersionWatcher:
    """Keeps one holder at a store's published versions.

    Args:
        store: the versioned store to follow.
        holder: what serves the versions, and their acceptance rule.
        events: the replica's recent version events (shown by /health); appended to.
        reconcile_interval_s: how often the pointers are read even without notifications.
        replica_id: who reports held versions (default: a fresh id).
        name: the thread's name.
    """

    def __init__(
        self,
        store: VersionedStore[Any, Any],
        holder: Holder,
        *,
        events: deque[dict[str, Any]],
        reconcile_interval_s: float = 1.0,
        replica_id: str | None = None,
        name: str = "version-watcher",
    ) -> None:
        self.store, self.holder, self.events = store, holder, events
        self.interval = reconcile_interval_s
        self.replica_id = replica_id or make_replica_id()
        self._refused: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def refused(self) -> set[tuple[str, int]]:
        """The (name, version) pairs this replica refused to load or rolled back."""
        return set(self._refused)

    def start(self) -> None:
        self.reconcile()  # pick up current versions before serving the first request
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)

    def reconcile(self) -> None:
        """Brings every name to the version its pointer names, then judges and reports."""
        for name in self.holder.names:
            try:
                version = self.store.current(name)
            except StoreError as exc:
                logger.warning("cannot read the pointer of %s: %s", name, exc)
                continue
            self.handle(PointerEvent(name, version))
        self.check_rollbacks()
        self.report_held()

    def report_held(self) -> None:
        """Tells the store which versions this replica holds, so they are not deleted."""
        holder = self.holder
        held = {name: [v for v in holder.held(name) if v] for name in holder.names}
        ttl_s = max(HELD_TTL_MIN_S, HELD_TTL_INTERVALS * self.interval)
        try:
            self.store.report_held(self.replica_id, held, ttl_s=ttl_s)
        except StoreError as exc:
            logger.warning("cannot report held versions: %s", exc)

    def handle(self, event: PointerEvent) -> None:
        """Loads and installs the version a pointer names, unless it serves or was refused."""
        holder, name, version = self.holder, event.name, event.version
        if name not in holder.names or version is None or version == holder.current(name):
            return
        if (name, version) in self._refused:
            return
        try:
            manifest, artefact = None, None
            if version != BASE_VERSION:  # going back to the base loads nothing
                manifest, artefact = self.store.load(name, version, **holder.expected(name))
            details = holder.install(name, version, manifest, artefact)
        except StoreUnavailable as exc:
            # Says nothing about the version: the next reconciliation fetches it again.
            logger.warning("cannot fetch %s v%s now: %s", name, version, exc)
            return
        except (StoreError, ValueError, OSError) as exc:
            self._refused.add((name, version))
            holder.count("refused", name, refusal_reason(exc))
            self._report("refused", name, version, reason=str(exc))
            return
        holder.count("swap", name)
        self._report("swap", name, version, **details)

    def check_rollbacks(self) -> None:
        """Asks the holder's rule about each name; rolls back what it finds worse."""
        holder = self.holder
        for name in holder.names:
            current, verdict = holder.current(name), holder.verdict(name)
            if verdict is None or current is None:
                continue
            if verdict.outcome == "kept":
                self._report("kept", name, current, **verdict.details)
                continue
            previous = verdict.to_version
            try:  # previous may be the base (BASE_VERSION): the pointer can name it
                self.store.rollback(name, previous, expected_current=current)
            except PublishConflict:
                pass  # another replica or the trainer moved the pointer first
            except StoreError as exc:
                logger.warning("rollback of %s v%s failed: %s", name, current, exc)
            if current != BASE_VERSION:  # the base is never refused
                self._refused.add((name, current))
            holder.roll_back(name, previous)
            holder.count("rollback", name)
            self._report("rollback", name, current, to_version=previous, **verdict.details)

    def _report(self, kind: str, name: str, version: int, **details: Any) -> None:
        label = self.holder.label or name
        event = {"event": kind, "adapter": label, "version": version, "time": time.time()}
        event.update(details)
        self.events.append(event)
        logger.info("version %s", event)

    def _run(self) -> None:
        single_threaded_torch()  # loads versions beside the decode loop (see osd.threads)
        subscription = None
        last = time.monotonic()
        while not self._stop.is_set():
            try:
                if subscription is None:
                    subscription = self.store.subscribe()
                event = subscription.get(timeout_s=min(self.interval, 0.5))
                if event is not None:
                    self.handle(event)
                if time.monotonic() - last >= self.interval:
                    self.reconcile()
                    last = time.monotonic()
                else:
                    self.check_rollbacks()
            except Exception as exc:  # noqa: BLE001 - keep watching; Redis may come back
                logger.warning("version watcher: %s", exc)
                if subscription is not None:
                    subscription.close()
                subscription = None
                self._stop.wait(self.interval)
        if subscription is not None:
            subscription.close()
