"""Per-replica adapter watcher: follows published versions and rolls back losers.

A background thread listens for publish notifications and also reconciles with the pointers
periodically (notifications can be lost). A new version is fetched and validated (sha256,
base-model hash, shapes; safetensors only) off the decode path and swapped in for new requests;
a refused version is counted and serving continues on the current one. The live monitor compares
each version's acceptance with its predecessor's over a window and rolls back a worse one.

Each reconciliation also reports the versions this replica holds (current and previous slot) to
the store, with a TTL of a few intervals, so the store's garbage collection never deletes a
version a replica may roll back to (`AdapterStore.report_held`, `osd.adapters.retention`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from typing import Any

from osd.adapters.lora import base_model_hash, install_adapter, lora_shapes
from osd.adapters.manifest import (
    BASE_VERSION,
    AdapterEvent,
    AdapterStoreError,
    AdapterStoreUnavailable,
    PublishConflict,
)
from osd.adapters.retention import make_replica_id
from osd.adapters.store import AdapterStore
from osd.threads import single_threaded_torch
from serving.adapter_slots import AdapterSlots, peft_adapter_name
from serving.live_monitor import LiveMonitor
from serving.metrics import ReplicaMetrics

__all__ = ["AdapterWatcher", "refusal_reason"]

logger = logging.getLogger(__name__)

# A held-versions report outlives this many reconcile intervals (at least HELD_TTL_MIN_S), so a
# slow load or a Redis hiccup does not let the versions it names go.
HELD_TTL_INTERVALS = 10
HELD_TTL_MIN_S = 10.0


def refusal_reason(exc: Exception) -> str:
    """The `reason` label of osd_adapter_refusals_total: what the store's check found
    (`osd.adapters.manifest.RefusalReason`), or the exception's type name for anything else."""
    return str(getattr(exc, "reason", None) or type(exc).__name__)


def _base_draft_stays_loaded(model: Any, peft_name: str) -> None:
    raise RuntimeError(f"{peft_name} (the base draft) should never have been unloaded")


class AdapterWatcher:
    """Keeps one replica's adapters at the published versions."""

    def __init__(
        self,
        slots: AdapterSlots,
        store: AdapterStore,
        *,
        monitor: LiveMonitor,
        metrics: ReplicaMetrics,
        events: deque[dict[str, Any]],
        reconcile_interval_s: float = 1.0,
        replica_id: str | None = None,
    ) -> None:
        """Keeps `slots` at `store`'s versions; rolls back what `monitor` finds worse, counts
        swaps, rollbacks and refusals in `metrics` and appends each to `events` (the replica's
        recent adapter events, shown by /health)."""
        self.slots, self.store, self.monitor = slots, store, monitor
        self.metrics, self.events = metrics, events
        self.interval = reconcile_interval_s
        self.replica_id = replica_id or make_replica_id()
        self.base_hash = base_model_hash(slots.model)
        # The layout every version must have, read before version 0 may be unloaded.
        self.shapes = {
            name: lora_shapes(slots.model, peft_adapter_name(name, 0)) for name in slots.adapters
        }
        self._refused: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adapter-watcher", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def refused(self) -> set[tuple[str, int]]:
        """The (adapter, version) pairs this replica refused to load or rolled back."""
        return set(self._refused)

    def start(self) -> None:
        self.reconcile()  # pick up current versions before serving the first request
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def reconcile(self) -> None:
        """Brings every adapter to the version its pointer names."""
        for adapter in self.slots.adapters:
            try:
                version = self.store.current(adapter)
            except AdapterStoreError as exc:
                logger.warning("cannot read pointer of %s: %s", adapter, exc)
                continue
            self.handle(AdapterEvent(adapter, version))
        self.check_rollbacks()
        self.report_held()

    def report_held(self) -> None:
        """Tells the store which versions this replica holds, so they are not deleted."""
        slots = self.slots
        held = {
            name: [v for v in (slots.current(name), slots.previous(name)) if v]
            for name in slots.adapters
        }
        ttl_s = max(HELD_TTL_MIN_S, HELD_TTL_INTERVALS * self.interval)
        try:
            self.store.report_held(self.replica_id, held, ttl_s=ttl_s)
        except AdapterStoreError as exc:
            logger.warning("cannot report held versions: %s", exc)

    def handle(self, event: AdapterEvent) -> None:
        slots, name, version = self.slots, event.name, event.version
        if name not in slots.adapters or version is None or version == slots.current(name):
            return
        if (name, version) in self._refused:
            return
        try:
            install = _base_draft_stays_loaded
            if version != BASE_VERSION:  # a rollback to the base draft loads nothing
                manifest, weights = self.store.load(
                    name,
                    version,
                    expected_base_model_hash=self.base_hash,
                    expected_shapes=self.shapes[name],
                )
                install = functools.partial(install_adapter, manifest=manifest, weights=weights)
            slots.swap_in(name, version, install, keep_previous=self._unproven(name))
        except AdapterStoreUnavailable as exc:
            # Says nothing about the version: the next reconciliation fetches it again.
            logger.warning("cannot fetch %s v%s now: %s", name, version, exc)
            return
        except (AdapterStoreError, ValueError, OSError) as exc:
            self._refused.add((name, version))
            self.metrics.adapter_refused(name, refusal_reason(exc))
            self._report("refused", name, version, reason=str(exc))
            return
        self.metrics.adapter_swapped(name)
        self._report("swap", name, version)

    def _unproven(self, name: str) -> bool:
        """Whether the current version never served a full window while its predecessor did:
        it is replaced before it could be judged, so the predecessor stays the baseline (else a
        quick succession of versions would never be compared with anything)."""
        slots = self.slots
        previous = slots.previous(name)
        return (
            previous is not None
            and self.monitor.rate(name, slots.current(name)) is None
            and self.monitor.rate(name, previous) is not None
        )

    def check_rollbacks(self) -> None:
        """Rolls back a current version whose live acceptance is worse than its predecessor's."""
        slots = self.slots
        for name in slots.adapters:
            current, previous = slots.current(name), slots.previous(name)
            if previous is None or not self.monitor.is_worse(name, current, previous):
                continue
            try:  # previous may be the base draft (BASE_VERSION): the pointer can name it
                self.store.rollback(name, previous, expected_current=current)
            except PublishConflict:
                pass  # another replica or the trainer moved the pointer first
            except AdapterStoreError as exc:
                logger.warning("rollback of %s v%s failed: %s", name, current, exc)
            if current != BASE_VERSION:  # the base draft is never refused
                self._refused.add((name, current))
            slots.roll_back(name, previous)
            self.metrics.adapter_rolled_back(name)
            self._report(
                "rollback",
                name,
                current,
                to_version=previous,
                new_rate=self.monitor.rate(name, current),
                old_rate=self.monitor.rate(name, previous),
            )

    def _report(self, kind: str, name: str, version: int, **details: Any) -> None:
        event = {"event": kind, "adapter": name, "version": version, "time": time.time(), **details}
        self.events.append(event)
        logger.info("adapter %s", event)

    def _run(self) -> None:
        single_threaded_torch()  # loads adapters beside the decode loop (see osd.threads)
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
                logger.warning("adapter watcher: %s", exc)
                subscription = None
                self._stop.wait(self.interval)
