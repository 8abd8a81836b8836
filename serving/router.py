"""Which draft adapter proposes a request's tokens (the mixture of drafts from the OSD paper).

In order: the request's ``draft`` field (an adapter name, or a domain that has its own
adapter), else its ``domain`` label, else a learned rule: an epsilon-greedy bandit per route over
the recent acceptance rate of each adapter. An unknown adapter falls back to the general one and
the fallback is reported.
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict, deque
from dataclasses import dataclass

__all__ = ["AdapterRouter", "RouteDecision"]


@dataclass(frozen=True)
class RouteDecision:
    """The adapter chosen for a request and why."""

    adapter: str
    route_key: str
    reason: str  # "draft", "domain", "bandit", "fallback"
    note: str = ""


class AdapterRouter:
    """Chooses among the draft's adapters; thread-safe.

    Args:
        adapters: logical adapter names available on the draft.
        general: the adapter used when nothing better is known.
        epsilon: exploration rate of the bandit.
        window: recent requests per (route, adapter) the bandit averages over.
    """

    def __init__(
        self,
        adapters: list[str],
        general: str = "general",
        *,
        epsilon: float = 0.1,
        window: int = 50,
        seed: int = 0,
    ) -> None:
        if general not in adapters:
            raise ValueError(f"general adapter {general!r} is not among {adapters}")
        self.adapters, self.general, self.epsilon = list(adapters), general, epsilon
        self._history: dict[tuple[str, str], deque[float]] = defaultdict(
            lambda: deque(maxlen=window)
        )
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def choose(self, draft: str | None = None, domain: str | None = None) -> RouteDecision:
        """Picks the adapter for one request."""
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
        return RouteDecision(self._bandit(route_key), route_key, "bandit")

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
