"""Per-replica routing-model watcher: follows the published version and rolls back a loser.

The routing model (`osd.routing`) is versioned like the adapters: the trainer publishes a
version and moves a pointer with compare-and-set (`osd.routing.store.RouterStore`). This thread
polls the pointer every `interval_s`, loads a new version off the decode path (safetensors, its
shapes and names checked) and hands it to the router for new requests; a version that fails the
checks is refused, counted as an event, and the current one stays.

A new version goes on **trial** against the one it replaces: `trial_share` of the unlabeled
requests (at random) are still routed by the predecessor, and the live monitor keeps each
version's acceptance over the trial's requests alone (key `serving.router.ROUTER_MONITOR_KEY`).
Comparing the two on the same traffic is the point: an adapter serves one domain, but the router
serves every domain, and comparing a version's requests with its predecessor's *earlier* ones
compares traffic mixes (measured: a router published at a shift to SQL was rolled back because
SQL, still new, was accepted less than code had been). Once both windows are full the new
version is kept (the trial ends) or, if worse by the adapters' rule, rolled back, in the store
too, so the trainer judges against the predecessor. A newer version starts a new trial against
the one serving. Version 0 stands for "no model": unlabeled requests go to the bandit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from osd.routing.model import RoutingModel
from osd.routing.store import (
    RouterConflict,
    RouterStore,
    RouterStoreError,
    RouterStoreUnavailable,
)
from serving.live_monitor import LiveMonitor
from serving.router import ROUTER_MONITOR_KEY, AdapterRouter

__all__ = ["RouterWatcher"]

logger = logging.getLogger(__name__)


class RouterWatcher:
    """Keeps one replica's router at the published routing model."""

    def __init__(
        self,
        router: AdapterRouter,
        store: RouterStore,
        *,
        monitor: LiveMonitor,
        events: deque[dict[str, Any]],
        interval_s: float = 1.0,
        trial_share: float = 0.2,
    ) -> None:
        self.router, self.store, self.monitor, self.events = router, store, monitor, events
        self.interval, self.trial_share = interval_s, trial_share
        self.current: int = 0  # the version routing now; 0: no model
        self.previous: int | None = None  # the version it is on trial against (None: no trial)
        self._models: dict[int, RoutingModel | None] = {0: None}
        self._refused: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-watcher", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self.reconcile()  # the first request already routes by the published model
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.store.close()

    def reconcile(self) -> None:
        """Loads the version the pointer names (if new), then checks for a rollback."""
        try:
            version = self.store.current() or 0
        except RouterStoreError as exc:
            logger.warning("cannot read the routing model's pointer: %s", exc)
            return
        if version != self.current and version not in self._refused:
            self._swap_in(version)
        self.check_rollback()

    def _swap_in(self, version: int) -> None:
        try:
            model = None if version == 0 else self.store.load(version).model
        except RouterStoreUnavailable as exc:
            logger.warning("cannot fetch routing model v%s now: %s", version, exc)
            return
        except RouterStoreError as exc:  # a bad version, not an outage: never again
            self._refused.add(version)
            self._report("refused", version, reason=str(exc))
            return
        previous = self.current
        if version < previous:  # the pointer went back (another replica rolled it back): no trial
            self._models = {version: model}
            self.current, self.previous = version, None
            self.router.set_model(model, version)
            self._report("swap", version)
            return
        self._models = {previous: self._models.get(previous), version: model}
        for v in (previous, version):  # both windows cover this trial's traffic alone
            self.monitor.forget(ROUTER_MONITOR_KEY, v)
        self.current, self.previous = version, previous
        self.router.set_model(
            model,
            version,
            baseline=(self._models[previous], previous),
            baseline_share=self.trial_share,
        )
        self._report("swap", version, trial_against=previous)

    def check_rollback(self) -> None:
        """Ends the running trial: rolls the current version back when its requests did worse
        than the predecessor's on the same traffic, or keeps it once both windows are full."""
        current, previous = self.current, self.previous
        if previous is None:
            return
        new_rate = self.monitor.rate(ROUTER_MONITOR_KEY, current)
        old_rate = self.monitor.rate(ROUTER_MONITOR_KEY, previous)
        if not self.monitor.is_worse(ROUTER_MONITOR_KEY, current, previous):
            if new_rate is not None and old_rate is not None:  # proven: the trial ends
                self.previous = None
                self.router.set_model(self._models.get(current), current)
                self._report("kept", current, new_rate=new_rate, old_rate=old_rate)
            return
        try:
            self.store.rollback(previous or None, expected_current=current or None)
        except RouterConflict:
            pass  # the trainer or another replica moved the pointer first
        except RouterStoreError as exc:
            logger.warning("rollback of routing model v%s failed: %s", current, exc)
        if current:
            self._refused.add(current)
        self.current, self.previous = previous, None
        self.router.set_model(self._models.get(previous), previous)
        self._report("rollback", current, to_version=previous, new_rate=new_rate, old_rate=old_rate)

    def _report(self, kind: str, version: int, **details: Any) -> None:
        event = {"event": kind, "adapter": "router", "version": version, "time": time.time()}
        event.update(details)
        self.events.append(event)
        logger.info("routing model %s", event)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.reconcile()
            except Exception as exc:  # noqa: BLE001 - keep watching; Redis may come back
                logger.warning("routing-model watcher: %s", exc)
