"""Workload files: round trip, line-numbered errors, schedules with topic shifts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from osd.demo import WorkloadItem, load_workload, make_workload, parse_schedule, write_workload
from osd.demo.synthetic import Chat

GOOD = {"prompt": "SELECT", "domain": "sql", "max_tokens": 16}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_written_workload_loads_back_equal(tmp_path):
    items = [
        WorkloadItem("def f(x):", "code", 32),
        WorkloadItem(
            "Question: 2 + 2?",
            "math",
            8,
            temperature=0.7,
            top_p=0.9,
            seed=3,
            adapter="math",
            id="r1",
            phase="mixed",
            metadata={"user": "u1", "tags": ["a"]},
        ),
    ]
    path = tmp_path / "w.jsonl"
    assert write_workload(items, path) == 2
    assert load_workload(path) == items
    assert json.loads(path.read_text().splitlines()[0]) == {
        "prompt": "def f(x):",
        "domain": "code",
        "max_tokens": 32,
    }


def test_blank_lines_are_skipped_and_integers_accepted_as_floats(tmp_path):
    path = _write(tmp_path / "w.jsonl", ["", json.dumps(GOOD | {"temperature": 1}), "  "])
    [item] = load_workload(path)
    assert item.temperature == 1.0 and isinstance(item.temperature, float)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x", "domain": ', "not valid JSON"),
        ('["x", "sql", 3]', "expected a JSON object"),
        (json.dumps({"prompt": "x", "domain": "sql"}), r"missing required keys \['max_tokens'\]"),
        (json.dumps(GOOD | {"temprature": 0.5}), "unknown keys"),
        (json.dumps(GOOD | {"prompt": ""}), "'prompt' must be a non-empty string"),
        (json.dumps(GOOD | {"domain": 3}), "'domain' must be a non-empty string"),
        (json.dumps(GOOD | {"max_tokens": 0}), "'max_tokens' must be an integer >= 1"),
        (json.dumps(GOOD | {"max_tokens": "16"}), "'max_tokens' must be an integer"),
        (json.dumps(GOOD | {"max_tokens": True}), "'max_tokens' must be an integer"),
        (json.dumps(GOOD | {"temperature": -1}), "'temperature' must be a number >= 0"),
        (json.dumps(GOOD | {"top_p": 0}), r"'top_p' must be a number in \(0, 1\]"),
        (json.dumps(GOOD | {"seed": 1.5}), "'seed' must be an integer"),
        (json.dumps(GOOD | {"adapter": 1}), "'adapter' must be a string"),
        (json.dumps(GOOD | {"metadata": [1]}), "'metadata' must be an object"),
    ],
)
def test_bad_line_raises_naming_its_line_number(tmp_path, line, message):
    path = _write(tmp_path / "w.jsonl", [json.dumps(GOOD), "", line, json.dumps(GOOD)])
    with pytest.raises(ValueError, match=message) as error:
        load_workload(path)
    assert "w.jsonl:3: " in str(error.value)


def test_empty_workload_raises(tmp_path):
    with pytest.raises(ValueError, match="no requests"):
        load_workload(_write(tmp_path / "w.jsonl", [""]))


def test_schedule_parses_in_order():
    assert parse_schedule("prose:2, code:3,mixed:1") == [("prose", 2), ("code", 3), ("mixed", 1)]


@pytest.mark.parametrize("text", ["prose", "prose:", ":3", "prose:0", "prose:-1", "code:2,sql"])
def test_malformed_schedule_raises(text):
    with pytest.raises(ValueError, match="domain:count"):
        parse_schedule(text)


PROMPTS = {"prose": ["p1", "p2"], "code": ["c1", "c2", "c3"], "sql": ["s1"]}


def test_workload_follows_the_schedule_and_cycles_prompts():
    items = make_workload(PROMPTS, [("prose", 3), ("code", 2), ("mixed", 40)], max_tokens=9)
    assert [i.domain for i in items[:5]] == ["prose"] * 3 + ["code"] * 2
    assert [i.phase for i in items[:5]] == ["prose"] * 3 + ["code"] * 2
    assert {i.prompt for i in items[:2]} == {"p1", "p2"}  # all prompts before any repeats
    mixed = items[5:]
    assert {i.domain for i in mixed} == set(PROMPTS) and {i.phase for i in mixed} == {"mixed"}
    assert all(i.prompt in PROMPTS[i.domain] and i.max_tokens == 9 for i in items)
    assert len({i.id for i in items}) == len(items)
    assert make_workload(PROMPTS, [("mixed", 40)], seed=1) != make_workload(
        PROMPTS, [("mixed", 40)], seed=2
    )
    assert make_workload(PROMPTS, [("mixed", 5)]) == make_workload(PROMPTS, [("mixed", 5)])


def test_workload_with_unknown_phase_raises():
    with pytest.raises(ValueError, match="'json'"):
        make_workload(PROMPTS, [("json", 1)])


def test_committed_demo_workload_loads_with_known_domains():
    path = Path(__file__).parents[2] / "workloads" / "demo_small.jsonl"
    items = load_workload(path)
    assert {i.domain for i in items} == {"prose", "code", "sql", "math", "json"}
    assert items[0].phase == "prose" and items[-1].phase == "mixed"


CHAT = {
    "messages": [{"role": "user", "content": "What is 2 + 2?"}],
    "domain": "math",
    "max_tokens": 8,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
DIALOGUES = {
    "sql": [Chat([{"role": "user", "content": f"query {i}"}]) for i in range(3)],
    "code": [Chat([{"role": "system", "content": "s"}, {"role": "user", "content": "def?"}])],
    "json": [Chat([{"role": "user", "content": "weather?"}], [WEATHER])],
}
TOOL_CHAT = CHAT | {
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "5 C"},
    ],
    "tools": [WEATHER],
}


def test_chat_items_round_trip_without_a_prompt(tmp_path):
    path = _write(tmp_path / "w.jsonl", [json.dumps(CHAT), json.dumps(GOOD)])
    chat, plain = load_workload(path)
    assert chat.is_chat and chat.messages == CHAT["messages"] and chat.prompt == ""
    assert not plain.is_chat and plain.messages is None
    again = tmp_path / "again.jsonl"
    write_workload([chat, plain], again)
    assert json.loads(again.read_text().splitlines()[0]) == CHAT  # no "prompt" key
    assert load_workload(again) == [chat, plain]


def test_tool_chats_round_trip(tmp_path):
    [chat] = load_workload(_write(tmp_path / "w.jsonl", [json.dumps(TOOL_CHAT)]))
    assert chat.tools == [WEATHER] and chat.messages == TOOL_CHAT["messages"]
    again = tmp_path / "again.jsonl"
    write_workload([chat], again)
    assert json.loads(again.read_text()) == TOOL_CHAT


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (CHAT | {"prompt": "x"}, "not both"),
        ({"domain": "sql", "max_tokens": 3}, r"missing required keys \['prompt or messages'\]"),
        (CHAT | {"messages": []}, "'messages' must be a non-empty list"),
        (CHAT | {"messages": [{"role": "function", "content": "x"}]}, r"messages\[0\] must be"),
        (CHAT | {"messages": [{"role": "user", "content": None}]}, r"messages\[0\] must be"),
        (CHAT | {"tools": {"type": "function"}}, "'tools' must be a list of objects"),
        ({"prompt": "x", "domain": "a", "max_tokens": 3, "tools": []}, "go with 'messages'"),
        (CHAT | {"messages": [{"role": "user"}]}, r"messages\[0\] must be"),
        (CHAT | {"messages": [{"role": "user", "content": 3}]}, r"messages\[0\] must be"),
    ],
)
def test_bad_chat_lines_are_refused(tmp_path, row, message):
    with pytest.raises(ValueError, match=message):
        load_workload(_write(tmp_path / "w.jsonl", [json.dumps(row)]))


def test_chat_share_turns_a_share_of_each_domain_with_dialogues_into_chats():
    schedule = [("prose", 20), ("sql", 200), ("mixed", 60)]
    plain = make_workload(PROMPTS, schedule)
    items = make_workload(PROMPTS, schedule, dialogues=DIALOGUES, chat_share=0.25)
    assert [i.domain for i in items] == [i.domain for i in plain]  # the same draws of domains
    assert [i.phase for i in items] == [i.phase for i in plain]
    chats = [i for i in items if i.is_chat]
    assert not any(i.is_chat for i in items if i.domain == "prose")  # no prose dialogues
    for item in chats:
        assert Chat(item.messages or [], item.tools) in DIALOGUES[item.domain]
        assert item.prompt == ""
    assert 30 <= sum(i.phase == "sql" for i in chats) <= 70  # about a quarter of 200
    assert {i.domain for i in chats} == {"sql", "code"}
    assert all(i.prompt in PROMPTS[i.domain] for i in items if not i.is_chat)
    assert make_workload(PROMPTS, schedule, dialogues=DIALOGUES, chat_share=0.0) == plain


def test_chat_phase_is_all_chats_on_random_topics():
    items = make_workload(PROMPTS, [("chat", 30), ("sql", 2)], dialogues=DIALOGUES)
    assert all(i.is_chat and i.phase == "chat" for i in items[:30])
    assert {i.domain for i in items[:30]} == {"sql", "code", "json"}
    assert all(i.tools == [WEATHER] for i in items[:30] if i.domain == "json")
    assert not any(i.is_chat for i in items[30:])  # chat_share 0
    with pytest.raises(ValueError, match="needs held-out dialogues"):
        make_workload(PROMPTS, [("chat", 1)])
    with pytest.raises(ValueError, match="chat_share"):
        make_workload(PROMPTS, [("sql", 1)], dialogues=DIALOGUES, chat_share=1.5)
