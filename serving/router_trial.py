"""The content router's model as the version watcher sees it: a trial against its predecessor.

`serving.watcher.VersionWatcher` follows the routing model's versions (`osd.routing.store`); this
holder hands a checked version to the router (`serving.router.AdapterRouter`) for new requests.

A new version goes on **trial** against the one it replaces: `trial_share` of the unlabeled
requests (at random) are still routed by the predecessor, and the live monitor keeps each
version's acceptance over the trial's requests alone (key `serving.router.ROUTER_MONITOR_KEY`).
Comparing the two on the same traffic is the point: an adapter serves one domain, but the router
serves every domain, and comparing a version's requests with its predecessor's *earlier* ones
compares traffic mixes (measured: a router published at a shift to SQL was rolled back because
SQL, still new, was accepted less than code had been). Once both windows are full the new
version is kept (the trial ends) or, if worse by the adapters' rule, rolled back, in the store
too, so the trainer judges against the predecessor. A newer version starts a new trial against
the one serving; a pointer that went back (another replica rolled back) is followed without
one. Version 0 (`BASE_VERSION`) stands for "no model": unlabeled requests go to the bandit.
"""

from __future__ import annotations

from typing import Any

from osd.routing.model import RoutingModel
from osd.versions.errors import BASE_VERSION
from serving.live_monitor import LiveMonitor
from serving.router import ROUTER_MONITOR_KEY, AdapterRouter
from serving.watcher import Verdict

__all__ = ["RouterTrial"]


class RouterTrial:
    """One replica's router, its routing model on trial against the predecessor."""

    label = "router"

    def __init__(
        self, router: AdapterRouter, monitor: LiveMonitor, trial_share: float, name: str
    ) -> None:
        """`name`: the routing model's name in its store (`routing_model_name` of the stream)."""
        self.names = (name,)
        self.router, self.monitor, self.trial_share = router, monitor, trial_share
        self.version: int = BASE_VERSION  # the version routing now
        self.previous: int | None = None  # the version it is on trial against (None: no trial)
        self._models: dict[int, RoutingModel | None] = {BASE_VERSION: None}

    def current(self, name: str) -> int:
        return self.version

    def held(self, name: str) -> list[int]:
        return [self.version] + ([] if self.previous is None else [self.previous])

    def expected(self, name: str) -> dict[str, Any]:
        return {}

    def install(
        self, name: str, version: int, manifest: Any, artefact: RoutingModel | None
    ) -> dict[str, Any]:
        previous = self.version
        if version < previous:  # the pointer went back (another replica rolled it back)
            self._models = {version: artefact}
            self.version, self.previous = version, None
            self.router.set_model(artefact, version)
            return {}
        self._models = {previous: self._models.get(previous), version: artefact}
        for v in (previous, version):  # both windows cover this trial's traffic alone
            self.monitor.forget(ROUTER_MONITOR_KEY, v)
        self.version, self.previous = version, previous
        self.router.set_model(
            artefact,
            version,
            baseline=(self._models[previous], previous),
            baseline_share=self.trial_share,
        )
        return {"trial_against": previous}

    def verdict(self, name: str) -> Verdict | None:
        """Ends the running trial: "rollback" when the current version's requests did worse
        than the predecessor's on the same traffic, "kept" once both windows are full."""
        current, previous = self.version, self.previous
        if previous is None:
            return None
        rates = {
            "new_rate": self.monitor.rate(ROUTER_MONITOR_KEY, current),
            "old_rate": self.monitor.rate(ROUTER_MONITOR_KEY, previous),
        }
        if self.monitor.is_worse(ROUTER_MONITOR_KEY, current, previous):
            return Verdict("rollback", previous, rates)
        if rates["new_rate"] is None or rates["old_rate"] is None:
            return None
        self.previous = None  # proven: the trial ends
        self.router.set_model(self._models.get(current), current)
        return Verdict("kept", current, rates)

    def roll_back(self, name: str, to_version: int) -> None:
        self.version, self.previous = to_version, None
        self.router.set_model(self._models.get(to_version), to_version)

    def count(self, event: str, name: str, reason: str | None = None) -> None:
        """Not counted in the metrics: the events show it (as they did before)."""
