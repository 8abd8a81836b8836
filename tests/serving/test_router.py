"""AdapterRouter (serving.router): which draft adapter a request gets, and why.

A pure decision over the request's fields and the acceptance fed back; no replica, no Ray.
"""

from __future__ import annotations

from collections import Counter

import pytest

from serving.router import AdapterRouter, RouteDecision

ADAPTERS = ["general", "code", "chat"]


def greedy_router(window: int = 50) -> AdapterRouter:
    """No exploration: the bandit always takes the best mean."""
    return AdapterRouter(ADAPTERS, epsilon=0.0, window=window)


def test_the_general_adapter_must_be_one_of_the_adapters():
    with pytest.raises(ValueError, match="'missing' is not among"):
        AdapterRouter(ADAPTERS, general="missing")


@pytest.mark.parametrize(
    ("draft", "domain", "decision"),
    [
        ("code", None, RouteDecision("code", "default", "draft")),
        ("code", "chat", RouteDecision("code", "chat", "draft")),  # the draft field wins
        (None, "chat", RouteDecision("chat", "chat", "domain")),
        (None, "legal", RouteDecision("general", "legal", "bandit")),  # no adapter of its own
        (None, None, RouteDecision("general", "default", "bandit")),
        ("", "", RouteDecision("general", "default", "bandit")),  # empty fields are absent
    ],
)
def test_the_request_fields_choose_before_the_bandit(draft, domain, decision):
    assert greedy_router().choose(draft=draft, domain=domain) == decision


def test_an_unknown_draft_falls_back_to_general_and_says_so():
    decision = greedy_router().choose(draft="nope", domain="chat")
    assert (decision.adapter, decision.reason) == ("general", "fallback")
    assert decision.route_key == "chat"
    assert "'nope'" in decision.note and "general" in decision.note


def test_the_bandit_takes_the_adapter_with_the_best_recent_acceptance_per_route():
    router = greedy_router()
    for rate in (0.6, 0.7):
        router.record("default", "code", rate)
        router.record("default", "general", rate - 0.3)
        router.record("legal", "chat", 0.9)
    assert router.choose().adapter == "code"
    assert router.choose(domain="legal").adapter == "chat"  # each route learns on its own
    assert router.choose(domain="fresh").adapter == "general"  # nothing known: general


def test_a_tie_goes_to_the_general_adapter():
    router = greedy_router()
    for name in ("chat", "general", "code"):
        router.record("default", name, 0.5)
    assert router.choose().adapter == "general"


def test_only_the_last_window_of_requests_counts():
    router = greedy_router(window=2)
    router.record("default", "code", 0.9)  # pushed out by the next two
    router.record("default", "general", 0.5)
    for rate in (0.2, 0.3):
        router.record("default", "code", rate)
    assert router.choose().adapter == "general"


def test_exploration_tries_every_adapter_at_the_rate_epsilon():
    router = AdapterRouter(ADAPTERS, epsilon=0.3, seed=1)
    router.record("default", "code", 0.9)
    chosen = Counter(router.choose().adapter for _ in range(3000))
    assert set(chosen) == set(ADAPTERS)
    # Exploring picks uniformly among all three (code included): the others get 0.1 each.
    for name in ("general", "chat"):
        assert 0.07 < chosen[name] / 3000 < 0.13, chosen
    assert all(router.choose().reason == "bandit" for _ in range(10))


def test_the_same_seed_explores_the_same_way():
    def picks(seed: int) -> list[str]:
        router = AdapterRouter(ADAPTERS, epsilon=0.5, seed=seed)
        return [router.choose().adapter for _ in range(50)]

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)


def test_a_single_adapter_is_never_explored_away_from():
    router = AdapterRouter(["general"], epsilon=1.0)
    assert {router.choose().adapter for _ in range(20)} == {"general"}
