"""Which draft adapter proposes a request's tokens (the mixture of drafts from the OSD paper).

In order: the request's ``draft`` field (an adapter name, or a domain that has its own
adapter), else its ``domain`` label, else (a request that names neither) the **content router**:
the published routing model (`osd.routing.model`, kept current by `serving.watcher` with
`serving.router_trial`) picks the adapter from the prompt's token ids when it is at least
`min_confidence` sure; else a learned rule: an epsilon-greedy bandit per route over the recent
acceptance rate of each adapter. An unknown adapter falls back to the general one and the
fallback is reported.
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from osd.routing.model import RoutingModel

__all__ = ["ROUTER_MONITOR_KEY", "AdapterRouter", "RouteDecision"]

# The live monitor's name for the routing model (no adapter name contains "@").
ROUTER_MONITOR_KEY = "@router"


@dataclass(frozen=True)
class RouteDecision:
    """The adapter chosen for a request and why."""

    adapter: str
    route_key: str
    reason: str  # "draft", "domain", "content", "bandit", "fallback"
    note: str = ""
    # The routing model version that decided an unlabeled request (0: none loaded); None for a
    # request that named its domain or draft. The live monitor judges router versions by it.
    router_version: int | None = None


class AdapterRouter:
    """Chooses among the draft's adapters; thread-safe.

    Args:
        adapters: logical adapter names available on the draft.
        general: the adapter used when nothing better is known.
        epsilon: exploration rate of the bandit.
        window: recent requests per (route, adapter) the bandit averages over.
        min_confidence: least probability of the routing model's choice it is followed at.
    """

    def __init__(
        self,
        adapters: list[str],
        general: str = "general",
        *,
        epsilon: float = 0.1,
        window: int = 50,
        seed: int = 0,
        min_confidence: float = 0.0,
    ) -> None:
        if general not in adapters:
            raise ValueError(f"general adapter {general!r} is not among {adapters}")
        self.adapters, self.general, self.epsilon = list(adapters), general, epsilon
        self._history: dict[tuple[str, str], deque[float]] = defaultdict(
            lambda: deque(maxlen=window)
        )
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.min_confidence = min_confidence
        self.model: RoutingModel | None = None
        self.model_version = 0
        self._baseline: tuple[RoutingModel | None, int] | None = None
        self._baseline_share = 0.0

    def set_model(
        self,
        model: RoutingModel | None,
        version: int,
        *,
        baseline: tuple[RoutingModel | None, int] | None = None,
        baseline_share: float = 0.0,
    ) -> None:
        """Routes unlabeled requests by `model` (version `version`) from now on; None: by the
        bandit alone. With `baseline` (a model and its version), a `baseline_share` of them is
        routed by it instead, at random: the A/B trial that judges the new version on the same
        traffic as its predecessor (`serving.router_trial`)."""
        with self._lock:
            self.model, self.model_version = model, version
            self._baseline, self._baseline_share = baseline, baseline_share

    def choose(
        self,
        draft: str | None = None,
        domain: str | None = None,
        prompt_ids: Sequence[int] = (),
    ) -> RouteDecision:
        """Picks the adapter for one request (`prompt_ids`: its prompt, for the content
        router)."""
        route_key = domain or "default"
        if draft:
            if draft in self.adapters:
                return RouteDecision(draft, route_key, "draft")
            return RouteDecision(
                self.general,
                route_key,
                "fallback",
                f"unknown draft {draft!r}: using {self.general}",
            )
        if domain and domain in self.adapters:
            return RouteDecision(domain, route_key, "domain")
        if domain:
            return RouteDecision(self._bandit(route_key), route_key, "bandit")
        with self._lock:
            model, version = self.model, self.model_version
            if self._baseline is not None and self._rng.random() < self._baseline_share:
                model, version = self._baseline
        if model is not None and len(prompt_ids):
            adapter, probability = model.predict(prompt_ids)
            if adapter in self.adapters and probability >= self.min_confidence:
                note = f"p={probability:.2f}"
                return RouteDecision(adapter, route_key, "content", note, router_version=version)
        return RouteDecision(self._bandit(route_key), route_key, "bandit", router_version=version)

    def record(self, route_key: str, adapter: str, acceptance_rate: float) -> None:
        """Feeds back the acceptance a request achieved with an adapter."""
        with self._lock:
            self._history[(route_key, adapter)].append(acceptance_rate)

    def _bandit(self, route_key: str) -> str:
        with self._lock:
            if len(self.adapters) > 1 and self._rng.random() < self.epsilon:
                return self._rng.choice(self.adapters)
            means = {
                name: sum(h) / len(h)
                for name in self.adapters
                if (h := self._history.get((route_key, name)))
            }
        if not means:
            return self.general
        return max(means, key=lambda name: (means[name], name == self.general))
