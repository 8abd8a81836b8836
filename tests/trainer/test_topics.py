"""TopicMap (trainer.topics): which domain adapter learns from an unlabeled record."""

from __future__ import annotations

from osd.routing import prompt_features
from tests.trainer.routing_fakes import SCORES, topic_examples, topic_of
from trainer.topics import TopicMap


def feed(topics: TopicMap, examples, versions=("general",)):
    """Assigns each example as the trainer would, with scores of the adapters in `versions`."""
    out = []
    for example in examples:
        scores = {a: SCORES[a][topic_of(example.record)] for a in versions}
        out.append(
            topics.assign(example.entry_id, prompt_features(example.record.token_ids[:12]), scores)
        )
    return out


def test_well_served_traffic_opens_no_topic_and_a_poorly_served_one_opens_the_first_free():
    topics = TopicMap(["code", "sql", "math"], "general", min_records=8)
    assert all(d == "" for d, _ in feed(topics, topic_examples("prose", 40)))
    assert topics.topics == {}
    results = feed(topics, topic_examples("code", 8))
    assert [d for d, _ in results[:7]] == [""] * 7  # pending until 8 of them came
    domain, taken = results[7]
    assert domain == "code" and taken == [f"code-{i}" for i in range(7)]
    # From then on the topic keeps its records, poorly served or not, and prose stays general.
    assert {d for d, _ in feed(topics, topic_examples("code", 10, start=8))} == {"code"}
    assert {d for d, _ in feed(topics, topic_examples("prose", 10, start=40))} == {""}


def test_a_second_new_topic_takes_the_next_free_adapter_never_a_labelled_one():
    topics = TopicMap(["code", "sql", "math"], "general", min_records=8)
    topics.claim("code")  # clients label code traffic themselves
    feed(topics, topic_examples("prose", 20))
    assert feed(topics, topic_examples("sql", 8))[-1][0] == "sql"
    assert feed(topics, topic_examples("code", 8))[-1][0] == "math"
    assert feed(topics, topic_examples("code", 1, start=8))[0][0] == "math"
    assert set(topics.topics) == {"sql", "math"} and topics.free == []


def test_a_domain_adapter_that_serves_a_record_best_learns_from_it():
    topics = TopicMap([], "general", min_records=8)
    results = feed(topics, topic_examples("sql", 3), versions=("general", "code", "sql"))
    assert [d for d, _ in results] == ["sql"] * 3
    results = feed(topics, topic_examples("prose", 3), versions=("general", "code", "sql"))
    assert [d for d, _ in results] == [""] * 3  # the general adapter wins there


def test_without_discovery_or_free_adapters_new_topics_stay_with_the_general_adapter():
    for topics in (
        TopicMap(["code"], "general", min_records=8, discover=False),
        TopicMap([], "general", min_records=8),
    ):
        feed(topics, topic_examples("prose", 20))
        assert {d for d, _ in feed(topics, topic_examples("code", 20))} == {""}
        assert topics.topics == {}


def test_a_domain_adapter_slightly_better_on_a_new_topic_does_not_take_it_over():
    topics = TopicMap(["sql"], "general", min_records=8)
    topics.claim("code")  # code has its own (labelled or earlier) adapter
    feed(topics, topic_examples("prose", 20))
    results = []
    for example in topic_examples("sql", 8):
        scores = {"general": 0.10, "code": 0.15}  # code beats general by a hair: both poor
        features = prompt_features(example.record.token_ids[:12])
        results.append(topics.assign(example.entry_id, features, scores))
    assert [d for d, _ in results] == [""] * 7 + ["sql"]
