"""Tool calling on /v1/chat/completions (issue 28, item 1), with the official client and with
LangChain's bind_tools: tools rendered by the chat template, replies parsed into tool_calls by
the hermes parser, tool_choice "required" and a named function enforced by a grammar (arguments
always parse and follow the schema), streamed tool_calls deltas equal to the whole answer,
finish_reason "tool_calls", the history's calls and tool results accepted, and every bad
combination a 400 naming its field."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest

from serving.protocol import parse_request
from tests.reliability.conftest import Replica, running_replica, toy_config

# A Hermes-style template in the toy tokenizer's alphabet (lowercase, digits, punctuation);
# the tools by name only: the toy models have 512 positions.
TEMPLATE = (
    "{%- if tools -%}tools:\n{%- for tool in tools %}\n{{ tool.function.name }}{% endfor %}\n"
    "{% endif -%}"
    "{%- for m in messages -%}{{ m.role }}: {{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n"
    "</tool_call>{% endfor %}\n{% endfor -%}"
    "{%- if add_generation_prompt %}assistant: {% endif -%}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CALC]
ASK = [{"role": "user", "content": "weather in oslo?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "oslo"}}\n</tool_call>'


@contextlib.contextmanager
def template_replica(template: str, parser: str | None = None) -> Iterator[Replica]:
    """A toy replica whose chat template is ``template``; ``parser``: the tool-call parser
    it must have detected from it."""
    config = toy_config("serve.max_tokens_limit=160", f"model.chat_template={json.dumps(template)}")
    with running_replica(config) as replica:
        assert parser is None or replica.runtime.tool_parser == parser
        yield replica


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with template_replica(TEMPLATE) as replica:
        yield replica


def call_history(name: str, arguments: str, result: str, call_id: str = "call_1") -> list:
    """``ASK``, an assistant's call of ``name`` with ``arguments`` (JSON text), its result."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def required_calls_follow_schema(client, seeds: int = 3) -> list:
    """``tool_choice: required`` answers with calls of offered tools (or runs out of tokens
    calling, but not every time): no content, arguments that follow the schema. Returns the
    calls."""
    calls = []
    for seed in range(seeds):
        choice = chat(client, tools=TOOLS, tool_choice="required", seed=seed).choices[0]
        assert choice.finish_reason in ("tool_calls", "length"), choice
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls and choice.message.content is None, choice
            assert all(follows_schema(call) for call in choice.message.tool_calls)
            calls += choice.message.tool_calls
    assert calls, "every answer ran out of tokens before its calls ended"
    return calls


def follows_schema(call) -> bool:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "calc":
        return set(arguments) == {"n"} and 0 <= arguments["n"] <= 99
    assert call.function.name == "get_weather"
    return (
        isinstance(arguments["city"], str)
        and len(arguments["city"]) <= 6
        and arguments.get("unit", "c") in ("c", "f")
    )


def chat(client, **fields):
    fields.setdefault("max_tokens", 150)
    return client.chat.completions.create(
        model="osd", messages=fields.pop("messages", ASK), **fields
    )


def streamed_calls(client, **fields) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of one streamed choice, accumulated as
    OpenAI's clients do (by each call's index)."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **fields):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            name, arguments = calls.get(part.index, ("", ""))
            calls[part.index] = (
                name + (part.function.name or ""),
                arguments + (part.function.arguments or ""),
            )
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def named_call_streams_as_whole(client, name: str, method: str | None = None, seed: int = 5):
    """A call forced by naming ``name`` (with speculation ``method``, or the default): streamed,
    it equals the whole answer, one call following the tool's schema, ending with ``stop``."""
    fields: dict = {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": name}},
        "seed": seed,
    }
    if method is not None:
        fields["extra_body"] = {"spec": {"method": method, "k": 3, "proposer": "draft"}}
    whole = chat(client, **fields).choices[0]
    content, calls, finish = streamed_calls(client, **fields)
    assert finish == whole.finish_reason == "stop"
    assert content == (whole.message.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [called for called, _ in calls] == [name]
    assert follows_schema(whole.message.tool_calls[0])


def test_required_always_calls_an_offered_tool_with_valid_arguments(client):
    for seed in range(4):
        choice = chat(
            client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed
        ).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert follows_schema(call), call


def test_a_named_function_is_the_one_called(client):
    named = {"type": "function", "function": {"name": "calc"}}
    for seed in range(3):
        choice = chat(client, tools=TOOLS, tool_choice=named, seed=seed).choices[0]
        assert choice.finish_reason == "stop"  # as OpenAI and vLLM answer a named choice
        [call] = choice.message.tool_calls
        assert call.function.name == "calc" and follows_schema(call)


def test_parallel_calls_each_follow_their_schema(client):
    for seed in range(3):
        choice = chat(client, tools=TOOLS, tool_choice="required", seed=seed).choices[0]
        assert choice.message.tool_calls, choice
        complete = choice.message.tool_calls
        assert all(follows_schema(call) for call in complete)
        assert choice.finish_reason in ("tool_calls", "length")


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        # auto: the model's own reply is read; a grammar makes this toy one write a call.
        {"tool_choice": "auto", "extra_body": {"structured_outputs": {"choice": [CALL_TEXT]}}},
        {"extra_body": {"structured_outputs": {"choice": [f"let me see.\n{CALL_TEXT}"]}}},
    ],
)
def test_streamed_tool_calls_equal_the_whole_answer(client, fields):
    whole = chat(client, tools=TOOLS, seed=5, **fields).choices[0]
    content, calls, finish = streamed_calls(client, tools=TOOLS, seed=5, **fields)
    named = isinstance(fields.get("tool_choice"), dict)
    assert finish == whole.finish_reason == ("stop" if named else "tool_calls")
    assert content == (whole.message.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_reads_calls_from_the_reply_and_leaves_plain_text_alone(client):
    forced = {"structured_outputs": {"choice": [f"let me see.\n{CALL_TEXT}"]}}
    choice = chat(client, tools=TOOLS, extra_body=forced).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "let me see."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "oslo"},
    )
    plain = {"structured_outputs": {"choice": ["it is sunny."]}}
    choice = chat(client, tools=TOOLS, extra_body=plain).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "it is sunny."
    assert not choice.message.tool_calls
    # A call of a function that was not offered is not a tool call: the client gets the text.
    unknown = CALL_TEXT.replace("get_weather", "rm_rf")
    choice = chat(
        client, tools=TOOLS, extra_body={"structured_outputs": {"choice": [unknown]}}
    ).choices[0]
    assert choice.message.content == unknown and not choice.message.tool_calls


def test_none_leaves_the_tools_out_of_the_prompt_and_the_reply_unread(client, replica):
    forced = {"structured_outputs": {"choice": [CALL_TEXT]}}
    choice = chat(client, tools=TOOLS, tool_choice="none", extra_body=forced).choices[0]
    assert choice.message.content == CALL_TEXT and choice.finish_reason == "stop"
    with_tools = chat(client, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    without = chat(client, tools=TOOLS, tool_choice="none", max_tokens=1).usage.prompt_tokens
    assert without == chat(client, max_tokens=1).usage.prompt_tokens < with_tools


def test_a_conversation_with_calls_and_results_is_rendered_for_the_model(client, replica):
    first = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=1)
    message = first.choices[0].message
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21 c"},
    ]
    answer = chat(client, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    request = parse_request("chat", {"model": "osd", "messages": history, "tools": TOOLS})
    rendered = replica.runtime.prompt_of(request, replica.runtime.tool_plan(request))
    arguments = json.loads(message.tool_calls[0].function.arguments)
    assert f'"arguments": {json.dumps(arguments)}' in rendered
    assert "tool: sunny, 21 c" in rendered and rendered.startswith("tools:get_weathercalc")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        *(  # arguments are an object: OpenAI refuses another type
            (
                {"tools": [{"type": "function", "function": {"name": "f", "parameters": p}}]},
                "tools[0].function.parameters",
            )
            for p in ({"type": "array", "items": {"type": "integer"}}, {"type": "string"})
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "21 c"}]}, "messages[0]"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "a",
                                "type": "function",
                                "function": {"name": "calc", "arguments": "{not json"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        *(
            (
                {
                    "messages": [
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {"type": "function", "function": {"name": "calc", "arguments": a}}
                            ],
                        }
                    ]
                },
                "messages[0].tool_calls[0].function.arguments",
            )
            for a in ("[1]", '"text"')  # JSON, but not an object
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(replica, fields, param):
    body = {"model": "osd", "messages": ASK, "max_tokens": 4, **fields}
    response = replica.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_completions_refuse_tools_by_name(replica):
    body = {"model": "osd", "prompt": "hi", "max_tokens": 2, "tools": TOOLS}
    response = replica.client.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_a_model_without_a_tool_format_refuses_tools_and_says_how_to_serve_them():
    with running_replica(toy_config()) as plain:  # the toy tokenizer has no chat template
        response = plain.client.post(
            "/v1/chat/completions",
            json={"model": "osd", "messages": ASK, "tools": TOOLS, "max_tokens": 2},
        )
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "tools"
        assert "serve.tool_call_parser" in error["message"]
        # Without tools (or with tool_choice none) the same chat is served.
        ok = plain.client.post(
            "/v1/chat/completions",
            json={
                "model": "osd",
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": "none",
                "max_tokens": 2,
            },
        )
        assert ok.status_code == 200, ok.text


def test_langchain_bind_tools_gets_tool_calls(replica):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model="osd",
        base_url="http://testserver/v1",
        api_key="x",
        http_client=replica.client,
        max_retries=0,
        max_tokens=150,
        seed=2,
    )

    def get_weather(city: str, unit: str = "c") -> str:
        """Weather now in a city.

        Args:
            city: the city.
            unit: c or f.
        """
        return "sunny"

    bound = model.bind_tools([get_weather], tool_choice="get_weather")
    reply = bound.invoke([HumanMessage("weather in oslo?")])
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert reply.response_metadata["finish_reason"] == "stop"  # a named choice, as OpenAI
    # The tool's result goes back in the history, and the model answers.
    history = [
        HumanMessage("weather in oslo?"),
        reply,
        ToolMessage("sunny", tool_call_id=call["id"]),
    ]
    answer = model.bind_tools([get_weather]).invoke(history, max_tokens=4)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    # Streamed, LangChain accumulates the deltas into the same call.
    chunks = list(bound.stream([HumanMessage("weather in oslo?")]))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]
