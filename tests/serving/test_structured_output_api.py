"""Structured output over HTTP with the official client (issue 14, item 2): OpenAI's
response_format (json_object, json_schema), vLLM's structured_outputs and guided_* fields, on
both endpoints, streamed and not; outputs parse and follow the schema; a grammar that does not
compile, or two asks at once, is a 400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest

from tests.reliability.conftest import Replica, running_replica, toy_config
from tests.serving.test_choices_api import create, text_of

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "kind": {"enum": ["sql", "json", "py"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "kind", "n"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with running_replica(toy_config("serve.max_tokens_limit=64")) as replica:
        yield replica


def follows_schema(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"ok", "kind", "n"}
        and isinstance(value["ok"], bool)
        and value["kind"] in ("sql", "json", "py")
        and isinstance(value["n"], int)
        and 0 <= value["n"] <= 99
    )


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_json_schema_outputs_parse_streamed_and_not(client, kind):
    extra = {"response_format": JSON_SCHEMA_FORMAT}
    whole = create(client, kind, max_tokens=64, seed=3, n=3, extra_body=extra)
    for choice in whole.choices:
        assert choice.finish_reason == "stop", text_of(kind, choice)
        assert follows_schema(text_of(kind, choice)), text_of(kind, choice)
    pieces = [
        (c.choices[0].delta.content if kind == "chat" else c.choices[0].text) or ""
        for c in create(client, kind, max_tokens=64, seed=3, stream=True, extra_body=extra)
        if c.choices
    ]
    assert "".join(pieces) == text_of(kind, whole.choices[0])


def test_json_object_is_a_json_object_or_an_unfinished_one(client):
    for seed in range(4):
        choice = create(
            client, "chat", max_tokens=40, seed=seed, response_format={"type": "json_object"}
        ).choices[0]
        text = choice.message.content
        assert text.startswith("{"), text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"structured_outputs": {"regex": "[ab]{2,5}-[0-9]"}}, r"[ab]{2,5}-[0-9]"),
        ({"guided_regex": "(yes|no)!"}, r"(yes|no)!"),
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, r"red|green|blue"),
        ({"guided_choice": ["up", "down"]}, r"up|down"),
        ({"structured_outputs": {"grammar": 'start: "x" NUM\nNUM: /[0-9]{1,3}/'}}, r"x[0-9]{1,3}"),
        # GBNF, as vLLM's xgrammar backend takes it.
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]? "."'}, r"x[0-9]{1,2}\."),
        ({"structured_outputs": {"json": SCHEMA}}, None),
        ({"guided_json": json.dumps(SCHEMA)}, None),
    ],
)
def test_vllm_structured_outputs(client, fields, check):
    for seed in range(3):
        choice = create(client, "completion", max_tokens=64, seed=seed, extra_body=fields)
        text = choice.choices[0].text
        assert choice.choices[0].finish_reason == "stop", text
        assert re.fullmatch(check, text) if check else follows_schema(text), text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"regex": "[ab"}}, "structured_outputs.regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_bad_structured_output_is_a_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, "completion", max_tokens=5, extra_body=fields)
    assert caught.value.body["param"] == param, caught.value.body


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"regex": "ab[A-Z]+"}}, "structured_outputs.regex"),
        ({"guided_regex": "a[A-Z]b"}, "guided_regex"),
    ],
)
def test_a_grammar_the_vocabulary_cannot_write_is_a_400_naming_the_field(
    client, replica, fields, param
):
    # The toy vocabulary has no capitals: the grammar compiles, then gives up while decoding.
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, "completion", max_tokens=5, extra_body=fields)
    body = caught.value.body
    assert body["param"] == param and "structured output failed" in body["message"], body
    # Streamed, the status line has gone: the same error comes in-band, and no [DONE].
    streamed = replica.complete(prompt="go", max_tokens=5, stream=True, **fields)
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "data: [DONE]" not in streamed.text
    assert replica.complete(prompt="go", max_tokens=5).status_code == 200  # the replica serves


def test_a_failing_grammar_fails_every_choice_and_prompt_of_its_request(replica):
    fields = {"structured_outputs": {"regex": "ab[A-Z]+"}, "max_tokens": 5}
    for many in ({"prompt": "go", "n": 3}, {"prompt": ["go", "stop", "went"]}):
        answer = replica.complete(**many, **fields)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "structured_outputs.regex"
    # Nothing is left holding the replica's places: a full batch is admitted at once.
    burst = replica.complete(prompt=["x"] * 8, max_tokens=2)
    assert burst.status_code == 200, burst.text
