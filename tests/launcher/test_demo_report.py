"""The demo report's arithmetic on hand-made samples (no stack)."""

from __future__ import annotations

import time

import pytest
from rich.console import Console

from launcher.demo_job import describe_reference, describe_routing
from launcher.demo_live import describe_chat, live_view, recent_by_domain
from launcher.demo_report import (
    chat_summary,
    describe_mix,
    domain_summary,
    first_versions,
    proposer_mix,
    reference_summary,
    routing_summary,
)
from launcher.demo_traffic import Sample, is_reference


def sample(phase, tokens, seconds, *, reference=False, drafted=10, acceptance=0.5, mean_k=2.0):
    """A finished request: ``tokens + 1`` tokens, the last ``tokens`` in ``seconds``."""
    return Sample(
        time=0.0,
        domain=phase,
        phase=phase,
        acceptance=acceptance,
        tokens=tokens + 1,
        latency=seconds + 0.5,
        decode_seconds=seconds,
        adapter="general",
        version=0,
        status=200,
        drafted=0 if reference else drafted,
        mean_k=0.0 if reference else mean_k,
        reference=reference,
    )


@pytest.mark.parametrize(
    ("concurrency", "every", "expected"),
    [(2, 10, [18, 19, 38, 39]), (1, 4, [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]), (4, 0, [])],
)
def test_reference_requests_come_in_windows_of_the_concurrency(concurrency, every, expected):
    assert [i for i in range(40) if is_reference(i, concurrency, every)] == expected


def test_reference_summary_compares_each_phase_with_its_own_reference_requests():
    samples = [sample("sql", 10, 1.0) for _ in range(4)]  # 10 tok/s right after the shift
    samples += [sample("sql", 30, 1.0, mean_k=4.0) for _ in range(4)]  # 30 tok/s at the end
    samples += [sample("sql", 40, 2.0, reference=True), sample("sql", 20, 1.0, reference=True)]
    samples += [sample("prose", 5, 1.0)]  # a phase without reference requests
    summary = reference_summary(samples)
    sql = summary["sql"]
    assert sql["reference"] == pytest.approx(20.0) and sql["reference_requests"] == 2
    assert sql["first_vs_reference"] == pytest.approx(0.5)
    assert sql["last_vs_reference"] == pytest.approx(1.5)
    assert sql["vs_reference"] == pytest.approx(1.0)
    assert (sql["mean_k_first"], sql["mean_k_last"]) == (2.0, 4.0)
    assert summary["prose"]["reference"] is None and summary["prose"]["vs_reference"] is None
    assert "n/a" in describe_reference(summary["prose"])
    assert "1.50x (k 4.00)" in describe_reference(sql)


def test_acceptance_comes_from_requests_that_drafted():
    samples = [sample("sql", 10, 1.0, acceptance=0.8) for _ in range(10)]
    samples += [sample("sql", 10, 1.0, drafted=0, acceptance=0.0, mean_k=0.0) for _ in range(5)]
    samples += [sample("sql", 10, 1.0, reference=True, acceptance=0.0)]
    assert domain_summary(samples)["sql"]["final"] == pytest.approx(0.8)
    recent = recent_by_domain(samples)["sql"]
    assert recent["acceptance"] == pytest.approx(0.8) and recent["requests"] == 16
    assert recent["mean_k"] == pytest.approx(2.0 * 10 / 15)


def test_the_live_line_on_the_loop_names_problems_and_restarts():
    from launcher.demo_live import describe_loop

    health = {"status": "degraded", "problems": ["trainer: no heartbeat for 40 s"]}
    supervision = {
        "redis-server": {"state": "running", "restarts": 0, "last_exit": ""},
        "trainer": {"state": "failed", "restarts": 5, "last_exit": "exit code 1"},
    }
    assert describe_loop(health, supervision) == (
        "loop: degraded; trainer: no heartbeat for 40 s; trainer failed, restarted 5x "
        "(last: exit code 1)"
    )
    assert describe_loop({"status": "ok", "problems": []}, {}) == "loop: ok"


def chat(topic, acceptance, *, text_chars=5, tools=0, calls=0):
    """A finished chat on ``topic`` (reported as the chat domain)."""
    return Sample(
        time=0.0,
        domain="chat",
        phase=topic,
        acceptance=acceptance,
        tokens=8,
        latency=1.0,
        adapter=topic,
        version=0,
        status=200,
        drafted=10,
        mean_k=2.0,
        endpoint="chat",
        topic=topic,
        text_chars=text_chars,
        tools_offered=tools,
        tool_calls=calls,
    )


def test_chats_are_a_domain_of_their_own_with_acceptance_per_topic():
    samples = [sample("sql", 10, 1.0, acceptance=0.9) for _ in range(10)]
    samples += [chat("sql", 0.2) for _ in range(10)] + [chat("sql", 0.6) for _ in range(10)]
    samples += [chat("math", 0.5, text_chars=0) for _ in range(3)]
    samples += [chat("json", 0.5, tools=2, calls=2), chat("json", 0.5, tools=1)]
    domains = domain_summary(samples)
    assert set(domains) == {"sql", "chat"} and domains["sql"]["final"] == pytest.approx(0.9)
    assert domains["chat"]["requests"] == 25
    summary = chat_summary(samples)
    assert summary["requests"] == 25 and summary["empty_responses"] == 3
    assert summary["topics"] == {"json": 2, "math": 3, "sql": 20}
    assert (summary["offered_tools"], summary["called_tools"], summary["tool_calls"]) == (2, 1, 2)
    assert set(summary["by_topic"]) == {"sql"}  # math: fewer than a window of chats
    assert summary["by_topic"]["sql"]["low"] == pytest.approx(0.2)
    assert summary["by_topic"]["sql"]["final"] == pytest.approx(0.6)
    assert set(recent_by_domain(samples)) == {"sql", "chat"}
    line = describe_chat(samples)
    assert "25 (json 2, math 3, sql 20), 3 empty, 2 offered tools (1 called one)" in line
    assert line.endswith("\n")
    assert describe_chat(samples[:10]) == ""
    assert chat_summary(samples[:10]) == {
        "requests": 0,
        "empty_responses": 0,
        "offered_tools": 0,
        "called_tools": 0,
        "tool_calls": 0,
        "topics": {},
        "by_topic": {},
    }


def test_first_versions_count_a_domains_requests_from_its_shift():
    def served(domain, time, adapter, version, topic=""):
        return Sample(time, domain, domain, 0.5, 10, 1.0, adapter, version, 200, topic=topic)

    samples = [served("prose", t, "general", 0) for t in range(5)]
    samples += [served("sql", 10 + t, "sql", 0) for t in range(6)]  # base draft until v1
    samples += [served("chat", 16.5, "sql", 0, topic="sql")]  # a chat about sql counts for sql
    samples += [served("sql", 17 + t, "sql", 1) for t in range(3)]
    samples += [served("math", 30 + t, "math", 0) for t in range(4)]  # never got a version
    published = [
        {"adapter": "general", "version": 1, "t": 3.0},
        {"adapter": "sql", "version": 1, "t": 14.5},
        {"adapter": "sql", "version": 2, "t": 18.0},
    ]
    firsts = first_versions(samples, published)
    assert sorted(firsts) == ["math", "sql"]  # prose has no adapter of its own
    assert firsts["sql"] == {"requests": 10, "published_after": 5, "served_after": 7}
    assert firsts["math"] == {"requests": 4, "published_after": None, "served_after": None}
    # v1 deleted by the end of a long run (bounded history): when it came is not known.
    firsts = first_versions(samples, published[2:])
    assert firsts["sql"] == {"requests": 10, "published_after": None, "served_after": 7}


def test_first_versions_of_unlabeled_traffic_follow_the_adapter_that_served_the_domain():
    def served(domain, time, adapter, version):
        return Sample(time, domain, domain, 0.5, 10, 1.0, adapter, version, 200)

    # Routed by content: the code requests went to the sql adapter, base draft until its v1.
    samples = [served("code", t, "general", 0) for t in range(2)]
    samples += [served("code", 2 + t, "sql", 0) for t in range(3)]
    samples += [served("code", 5 + t, "sql", 1) for t in range(5)]
    samples += [served("prose", 20 + t, "general", 0) for t in range(4)]  # no adapter served it
    published = [{"adapter": "sql", "version": 1, "t": 3.5}]
    assert first_versions(samples, published) == {}  # labelled: code's own adapter never served
    firsts = first_versions(samples, published, labels=False)
    assert sorted(firsts) == ["code"]
    assert firsts["code"] == {
        "requests": 10,
        "published_after": 4,
        "served_after": 5,
        "adapter": "sql",
    }


def test_routing_summary_reports_the_first_and_last_served_accuracy():
    points = [
        {
            "time": 105.0,
            "outcome": "published",
            "version": 1,
            "served_accuracy": None,
            "served_records": 0,
            "topics": {},
            "model_accuracy": 0.7,
        },
        {
            "time": 130.0,
            "outcome": "kept",
            "version": 1,
            "served_accuracy": 0.8,
            "served_records": 40,
            "topics": {"sql": 40},
            "model_accuracy": None,
        },
    ]
    routing = routing_summary(points, start=100.0)
    assert routing["first"] == routing["last"] == 0.8 and routing["published"] == 1
    assert [p["t"] for p in routing["points"]] == [5.0, 30.0]
    assert routing["points"][0] == {
        "t": 5.0,
        "served_accuracy": None,
        "model_accuracy": 0.7,
        "version": 1,
        "outcome": "published",
    }
    assert "first 0.80, last 0.80 over 2 points; router versions 1" in describe_routing(routing)
    empty = routing_summary([], start=100.0)
    assert empty == {"points": [], "first": None, "last": None, "published": 0}
    assert describe_routing(empty) == ""


def test_the_proposer_mix_counts_speculative_requests_and_shows_in_the_live_view():
    mixed = sample("sql", 10, 1.0)
    mixed.proposers = {
        "draft": {"steps": 2, "drafted": 4, "accepted": 1},
        "suffix": {"steps": 3, "drafted": 12, "accepted": 9},
    }
    alone = sample("sql", 10, 1.0, reference=True)
    alone.proposers = {"suffix": {"steps": 9, "drafted": 99, "accepted": 0}}  # never counted
    mix = proposer_mix([mixed, alone, sample("prose", 5, 1.0)])
    assert mix["suffix"] == {"drafted": 12, "accepted": 9, "acceptance": 0.75, "share": 0.75}
    assert mix["draft"]["share"] == 0.25 and mix["draft"]["acceptance"] == 0.25
    assert describe_mix(mix) == "suffix 75 % (acc 0.75), draft 25 % (acc 0.25)"
    assert describe_mix({}) == "none"

    class Driver:
        start_time, failures, samples = time.monotonic(), 0, [mixed, alone]

    table = live_view(Driver(), {}, 2)  # type: ignore[arg-type]
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "suffix 75 % (acc 0.75)" in text and "drafted by (whole run)" in text


def test_the_live_view_names_each_trainer_worker_and_its_adapters():
    from launcher.demo_live import describe_workers

    health = {
        "trainer_workers": [
            {"worker": "a", "adapters": ["general", "code"], "lag": 0, "dispatching": True},
            {"worker": "b", "adapters": [], "lag": 0, "dispatching": False},
        ]
    }
    assert describe_workers(health) == (
        "trainer workers: a (general, code) lag 0, dispatching; b (none) lag 0\n"
    )
    assert describe_workers({"status": "ok"}) == ""
