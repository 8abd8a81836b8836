"""RoutingTrainer (trainer.routing): labels from scores, topics for unlabeled records, and a
routing model fit, judged and published by the acceptance it routes to."""

from __future__ import annotations

from osd.config import RoutingConfig
from osd.routing.store import RoutingStats, open_routing_store, routing_model_name
from osd.versions.errors import BASE_VERSION
from tests.trainer.routing_fakes import FakeScorer, topic_examples, topic_record
from trainer.routing import RoutingTrainer

ADAPTERS = ["general", "code", "sql", "math"]


def routing(versions, store=None, *, name="log", stats=None, **config):
    scorer = FakeScorer()
    cfg = RoutingConfig(fit_every=8, **config)
    trainer = RoutingTrainer(
        ADAPTERS, scorer, versions, cfg, store, name=name, stats=stats, min_records=8
    )
    return trainer, scorer


def test_a_shift_opens_a_topic_and_the_router_learns_to_send_it_there():
    versions = {"general": 1, "code": None, "sql": None, "math": None}
    router, _ = routing(versions)
    assert set(router.observe(topic_examples("prose", 24))[0].values()) == {""}
    assigned, taken = router.observe(topic_examples("code", 8))
    # The eighth code record opens a topic on the first free adapter and brings the others.
    assert assigned["code-7"] == "code"
    assert sorted(e.entry_id for e, d in taken if d == "code") == [f"code-{i}" for i in range(7)]
    assert router.maybe_fit() == "waiting"  # only the general adapter has a version
    versions["code"] = 1  # the topic's adapter published its first version
    router.observe(topic_examples("code", 16, start=8) + topic_examples("prose", 8, start=24))
    assert router.maybe_fit() == "published"
    model = router.model
    assert model is not None and set(model.classes) == {"general", "code"}
    prompt = lambda r: r.token_ids[: r.prompt_len]  # noqa: E731
    assert model.predict(prompt(topic_record("code", 999)))[0] == "code"
    assert model.predict(prompt(topic_record("prose", 999)))[0] == "general"
    assert router.last_metrics["routing/model_accuracy"] >= 0.9


def test_a_candidate_no_better_than_the_current_model_is_refused():
    versions = {"general": 1, "code": 1, "sql": None, "math": None}
    router, _ = routing(versions)
    router.observe(topic_examples("code", 16) + topic_examples("prose", 16))
    assert router.maybe_fit() == "published"
    router.observe(topic_examples("code", 8, start=16))
    assert router.maybe_fit() == "refused"  # routes as well as the current one, no better
    assert router.maybe_fit() is None  # not due: no new records


def test_labelled_traffic_costs_no_scoring_and_claims_its_adapter():
    versions = {"general": 1, "code": 1, "sql": None, "math": None}
    router, scorer = routing(versions)
    assigned = router.observe(topic_examples("sql", 24, domain="sql"))
    assert assigned == ({}, []) and router.maybe_fit() is None and scorer.calls == {}
    assert "sql" not in router.topics.free


def test_stale_scores_are_recomputed_after_a_new_version():
    versions = {"general": 1, "code": 1, "sql": None, "math": None}
    router, scorer = routing(versions)
    router.observe(topic_examples("code", 16))
    assert scorer.calls == {"general": 16, "code": 16}
    router.maybe_fit()
    assert scorer.calls == {"general": 16, "code": 16}  # nothing stale
    versions["code"] = 2
    router.observe(topic_examples("code", 8, start=16))
    router.maybe_fit()
    assert scorer.calls["code"] == 16 + 8 + 16  # the new records, then the old ones again
    assert scorer.calls["general"] == 24


def test_routing_can_be_switched_off():
    versions = {"general": 1, "code": 1, "sql": None, "math": None}
    router, scorer = routing(versions, enabled=False)
    assert set(router.observe(topic_examples("code", 16))[0].values()) == {""}
    assert router.maybe_fit() is None and scorer.calls == {}


def test_published_models_and_accuracy_points_reach_the_store(redis_url, stream):
    versions = {"general": 1, "code": 1, "sql": None, "math": None}
    store, stats = open_routing_store(redis_url), RoutingStats(redis_url, stream)
    name = routing_model_name(stream)
    router, _ = routing(versions, store, name=name, stats=stats)
    served_well = topic_examples("code", 8, served="code") + topic_examples("prose", 8)
    router.observe(served_well + topic_examples("code", 8, start=8))  # these went to general
    assert router.maybe_fit() == "published"
    assert store.current(name) == router.version == 1
    assert store.load(name, 1)[1].classes == ("general", "code")
    (point,) = stats.all()
    assert point["outcome"] == "published" and point["served_accuracy"] == 16 / 24
    # A replica rolled it back meanwhile: the next fit judges against what replicas serve.
    store.rollback(name, BASE_VERSION, expected_current=1)
    versions["code"] = 2
    router.observe(topic_examples("code", 8, start=16))
    assert router.maybe_fit() == "published"  # against no model: anything routes better
    assert store.current(name) == router.version == 2
    store.rollback(name, 1, expected_current=2)
    router.observe(topic_examples("code", 8, start=24))
    # The trainer follows the pointer back to v1 and judges against it: no better, refused.
    assert router.maybe_fit() == "refused"
    assert router.version == store.current(name) == 1
    # A trainer that restarts resumes from the pointer.
    restarted = routing(versions, open_routing_store(redis_url), name=name)[0]
    assert restarted.version == store.current(name)
    restarted.close()
    store.close()
    stats.close()


def test_a_busy_domain_does_not_starve_the_others_rescoring(monkeypatch):
    monkeypatch.setattr("trainer.routing.RESCORE_PER_FIT", 16)
    versions = {"general": 1, "code": 1, "sql": 1, "math": None}
    router, scorer = routing(versions)
    router.observe(topic_examples("code", 24))
    router.observe(topic_examples("sql", 64))
    assert set(router.windows.by_domain()) == {"code", "sql"}
    versions.update(code=2, sql=2)  # every score is stale now
    scorer.calls.clear()
    router._since_fit = router.cfg.fit_every
    router.maybe_fit()
    # 16 records re-scored, 8 from each domain's window, not 16 of the newest (all SQL).
    assert scorer.calls == {"code": 16, "sql": 16}
    windows = router.windows.by_domain()
    rescored = {d: sum(s.scores["code"][0] == 2 for s in w) for d, w in windows.items()}
    assert rescored == {"code": 8, "sql": 8}


def test_with_the_general_adapter_alone_nothing_is_scored():
    scorer = FakeScorer()
    router = RoutingTrainer(["general"], scorer, {"general": 1}, RoutingConfig(fit_every=8))
    assert set(router.observe(topic_examples("code", 16))[0].values()) == {""}
    assert router.maybe_fit() is None and scorer.calls == {}
