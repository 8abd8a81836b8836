"""AdapterRouter (serving.router): which draft adapter a request gets, and why.

A pure decision over the request's fields and the acceptance fed back; no replica, no Ray.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from osd.routing import RoutingModel, fit_routing_model, stack_features
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
        # No label: the content router's decision (version 0: no routing model loaded).
        (None, None, RouteDecision("general", "default", "bandit", router_version=0)),
        ("", "", RouteDecision("general", "default", "bandit", router_version=0)),
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


def content_model(adapter: str = "code") -> RoutingModel:
    """A routing model sure that prompts of low token ids go to `adapter`, others to general."""
    low, high = stack_features([[1, 2, 3, 4]] * 4), stack_features([[40, 41, 42, 43]] * 4)
    features = np.concatenate([low, high])
    return fit_routing_model(features, [adapter] * 4 + ["general"] * 4, ["general", adapter])


def test_unlabeled_requests_follow_the_routing_model_when_it_is_sure():
    router = greedy_router()
    router.set_model(content_model(), 7)
    decision = router.choose(prompt_ids=[1, 2, 3, 4])
    assert (decision.adapter, decision.reason, decision.router_version) == ("code", "content", 7)
    assert router.choose(prompt_ids=[40, 41, 42, 43]).adapter == "general"
    # A label or a draft still decides, and is not the routing model's doing.
    assert router.choose(domain="chat", prompt_ids=[1, 2, 3, 4]) == RouteDecision(
        "chat", "chat", "domain"
    )
    assert router.choose(domain="legal", prompt_ids=[1, 2, 3, 4]).reason == "bandit"


def test_an_unsure_routing_model_or_an_unknown_adapter_leaves_it_to_the_bandit():
    router = AdapterRouter(ADAPTERS, epsilon=0.0, min_confidence=0.999)
    router.set_model(content_model(), 3)
    decision = router.choose(prompt_ids=[1, 2, 3, 4])
    assert (decision.reason, decision.router_version) == ("bandit", 3)
    other = greedy_router()
    other.set_model(content_model("legal"), 4)  # an adapter this replica does not have
    assert other.choose(prompt_ids=[1, 2, 3, 4]).reason == "bandit"
    other.set_model(None, 0)
    assert other.choose(prompt_ids=[1, 2, 3, 4]).router_version == 0
