"""OpenAI's Responses API (serving.responses_api) with the official client: the same answer as
the chat request it reads into, streamed events that the client's ``responses.stream``
accumulates into the whole response, function tools called and their history taken back,
structured output, logprobs, and what osd does not do refused by name."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator

import openai
import pytest
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming

from serving.chat_replies import ChatReply
from serving.reasoning import ReasoningReader
from serving.responses_api import (
    RESPONSES_FIELDS,
    ResponseEvents,
    read_responses_request,
)
from serving.tool_parsers import tool_call_format
from serving.tools import ToolPlan
from tests.reliability.conftest import Replica
from tests.serving.test_tools_api import CALC as CHAT_CALC
from tests.serving.test_tools_api import CALL_TEXT, TEMPLATE, follows_schema, template_replica
from tests.serving.test_tools_api import WEATHER as CHAT_WEATHER


def flat(tool: dict) -> dict:
    """A chat function tool as the Responses API spells it (its function's fields inline)."""
    return {"type": "function", **tool["function"]}


CALC, WEATHER = flat(CHAT_CALC), flat(CHAT_WEATHER)


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with template_replica(TEMPLATE) as replica:
        yield replica


def whole_and_streamed(client, **fields) -> tuple:
    """One request's Response answered whole, and as the client accumulates it streamed
    (completed answers only)."""
    whole = client.responses.create(model="osd", **fields)
    with client.responses.stream(model="osd", **fields) as stream:
        return whole, stream.get_final_response()


def respond(client, **fields):
    fields.setdefault("max_output_tokens", 12)
    fields.setdefault("temperature", 0)
    return client.responses.create(model="osd", **fields)


def test_every_field_of_openais_responses_request_has_a_row():
    fields = set(typing.get_type_hints(ResponseCreateParamsNonStreaming)) | {"stream"}
    assert fields <= set(RESPONSES_FIELDS), sorted(fields - set(RESPONSES_FIELDS))


def test_an_answer_is_the_chat_answer_of_the_same_conversation(client):
    answer = respond(client, instructions="be brief.", input="hello there")
    chat = client.chat.completions.create(
        model="osd",
        messages=[
            {"role": "system", "content": "be brief."},
            {"role": "user", "content": "hello there"},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert answer.object == "response" and answer.id.startswith("resp_")
    assert answer.output_text == chat.choices[0].message.content
    [message] = answer.output
    assert message.type == "message" and message.role == "assistant"
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert answer.status == ("incomplete" if cut else "completed")
    assert (answer.incomplete_details is not None) == cut
    assert answer.instructions == "be brief." and answer.store is False


def items(response) -> list[tuple[str, str | None, str | None]]:
    """Each output item's type, and a call's name and arguments."""
    return [
        (i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in response.output
    ]


SAID = f"let me see.\n{CALL_TEXT}\nthat is all."


@pytest.mark.parametrize(
    "fields",
    [
        {"input": "hello there"},
        {
            "input": "weather in oslo?",
            "tools": [CALC, WEATHER],
            "max_output_tokens": 150,
            "extra_body": {"structured_outputs": {"choice": [SAID]}},
        },
        {
            "input": "hi",
            "tools": [CALC],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": 120,
        },
        {
            "input": "hi",
            "tools": [CALC, WEATHER],
            "tool_choice": {"type": "function", "name": "calc"},
            "max_output_tokens": 120,
        },
    ],
)
def test_streamed_events_accumulate_to_the_whole_response(client, fields):
    fields = {"max_output_tokens": 40, "temperature": 0, **fields}
    whole = client.responses.create(model="osd", **fields)
    with client.responses.stream(model="osd", **fields) as stream:
        events = list(stream)
        # What the client accumulated (its get_final_response: completed ones only).
        final = stream.get_final_response() if whole.status == "completed" else events[-1].response
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == f"response.{whole.status}"
    assert final.output_text == whole.output_text
    assert items(final) == items(whole)
    if "tool_choice" in fields:
        assert whole.status == "completed" and [i.type for i in whole.output] == ["function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text


def test_a_forced_call_is_a_function_call_item_and_its_result_is_taken_back(client, replica):
    answer = respond(
        client,
        input="weather in oslo?",
        tools=[CALC, WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=150,
    )
    [call] = [item for item in answer.output if item.type == "function_call"]
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert follows_schema(type("Call", (), {"function": call})())
    history = [
        {"role": "user", "content": "weather in oslo?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 c"},
    ]
    after = respond(client, input=history, tools=[CALC, WEATHER], max_output_tokens=4)
    assert after.status in ("completed", "incomplete")
    chat = read_responses_request({"model": "osd", "input": history}).chat
    assert chat["messages"][1]["tool_calls"][0]["function"]["name"] == call.name
    assert chat["messages"][2] == {
        "role": "tool",
        "tool_call_id": call.call_id,
        "content": "sunny, 21 c",
    }


def test_a_json_schema_format_is_followed(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "count", "schema": schema, "strict": True}
    answer = respond(client, input="count", text={"format": fmt}, max_output_tokens=40)
    assert set(json.loads(answer.output_text)) == {"n"}
    assert answer.text.format.type == "json_schema"


def test_logprobs_come_with_the_output_text_when_included_whole_and_streamed(client):
    fields = {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    answer = respond(client, **fields)
    part = answer.output[0].content[0]
    assert len(part.logprobs) == answer.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert "".join(entry.token for entry in part.logprobs) == part.text
    with client.responses.stream(model="osd", max_output_tokens=12, temperature=0, **fields) as s:
        events = list(s)
    deltas = [e.logprobs for e in events if e.type == "response.output_text.delta"]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [x.token for x in done.logprobs] == [x.token for x in part.logprobs]
    assert sum(len(d) for d in deltas) == len(done.logprobs)
    # As OpenAI's: none without the include (top_logprobs alone asks for none).
    for plain in ({}, {"top_logprobs": 2}):
        assert respond(client, input="hi", **plain).output[0].content[0].logprobs == []


def test_a_whole_answer_gives_its_items_in_the_order_the_reply_said_them(client):
    answer = respond(
        client,
        input="weather in oslo?",
        tools=[CALC, WEATHER],
        max_output_tokens=150,
        extra_body={"structured_outputs": {"choice": [SAID]}},
    )
    assert items(answer) == [
        ("message", None, None),
        ("function_call", "get_weather", '{"city": "oslo"}'),
        ("message", None, None),
    ]
    assert [item.content[0].text for item in answer.output if item.type == "message"] == [
        "let me see.",
        "that is all.",
    ]


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
            "unsupported_parameter",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", None),
        ({"extra_body": {"messages": []}}, "messages", "unknown_parameter"),
        ({"extra_body": {"max_tokens": 3}}, "max_tokens", "unknown_parameter"),
        ({"extra_body": {"max_token": 3}}, "max_token", "unknown_parameter"),
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "unsupported_parameter"),
        ({"extra_body": {"user": 5}}, "user", "invalid_type"),
        ({"store": "yes"}, "store", "invalid_type"),
        ({"input": [{"type": "reasoning", "summary": 1}]}, "input[0].summary", "invalid_type"),
        ({"input": [{"type": "reasoning", "content": "x"}]}, "input[0].content", "invalid_type"),
        ({"input": [{"id": "msg_1"}]}, "input[0].type", "unsupported_parameter"),
        ({"input": [{"type": "compaction"}]}, "input[0].type", "unsupported_parameter"),
        ({"tools": ["calc"]}, "tools[0]", "invalid_type"),
        ({"tools": [{**CALC, "defer_loading": True}]}, "tools[0].defer_loading", None),
        ({"tools": [{**CALC, "colour": 1}]}, "tools[0].colour", "unknown_parameter"),
        ({"text": {"format": {"type": "text", "x": 1}}}, "text.format.x", "unknown_parameter"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", None),
        ({"reasoning": {"depth": 1}}, "reasoning.depth", "unknown_parameter"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}},
            "text.format.schema",
            None,
        ),
    ],
)
def test_what_osd_does_not_do_is_refused_by_name(client, fields, param, code):
    fields = {"input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        respond(client, **fields)
    error = refused.value.body
    assert error["param"] == param, error
    assert code is None or error["code"] == code


def test_clients_defaults_and_osds_own_fields_are_accepted(client):
    answer = respond(
        client,
        input=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        ],
        store=True,
        truncation="disabled",
        metadata={"who": "test"},
        user="u1",
        reasoning={"summary": "auto"},
        max_tool_calls=3,
        tools=[{**CALC, "defer_loading": False, "allowed_callers": ["direct"]}],
        tool_choice="none",
        extra_body={"seed": 3, "top_k": 5, "log": False, "spec": {"method": "none"}},
    )
    assert answer.store is False and answer.metadata == {"who": "test"}
    assert answer.output_text == respond(client, input="hi").output_text


def test_items_come_in_the_order_the_reply_said_them_whole_and_streamed():
    """Thinking as a reasoning item first, then text and calls in their order: the whole
    response is read by the same events a stream sends."""
    asked = read_responses_request({"model": "osd", "input": "q", "reasoning": {"effort": "low"}})
    assert asked.chat["reasoning_effort"] == "low"
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    said = [
        {"reasoning": "hm"},
        {"reasoning": "m"},
        {"content": "let me see."},
        {"tool_calls": [{"index": 0, **call}]},
        {"content": "<tool_call>"},  # an unfinished second call, cut by the token limit
    ]
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    whole = asked.response(said, "length", None, usage)
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "message", "function_call", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert whole["status"] == "incomplete" and whole["usage"]["output_tokens"] == 3
    events = ResponseEvents(asked)
    streamed = events.start()
    for delta in said:
        streamed += events.feed({"choices": [{"delta": delta, "finish_reason": None}]})
    streamed += events.feed({"choices": [{"delta": {}, "finish_reason": "length"}]})
    streamed += events.finish(usage, None)
    last = streamed[-1]
    assert last["type"] == "response.incomplete"
    assert [{**item, "id": ""} for item in last["response"]["output"]] == [
        {**item, "id": ""} for item in whole["output"]
    ]
    assert [e["sequence_number"] for e in streamed] == list(range(len(streamed)))


def test_a_reasoning_item_in_the_input_is_the_next_assistant_turns_thinking():
    items = [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "t"}]},
        {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
    ]
    messages = read_responses_request({"model": "osd", "input": items}).chat["messages"]
    assert messages[1]["reasoning"] == "t" and messages[1]["content"] is None
    assert messages[2]["role"] == "tool"


def test_the_chat_requests_errors_name_the_responses_fields(client):
    with pytest.raises(openai.BadRequestError) as refused:
        respond(client, input="hi", max_output_tokens=100_000)
    assert refused.value.body["param"] == "max_output_tokens"
    assert "max_output_tokens" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        respond(client, input=[])
    assert refused.value.body["param"] == "input"


def test_stored_responses_are_not_found_with_a_reason(client):
    for call in (
        lambda: client.responses.retrieve("resp_1"),
        lambda: client.responses.delete("resp_1"),
        lambda: client.responses.cancel("resp_1"),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert "osd stores no responses" in missing.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.input_tokens.count(model="osd", input="hi")
    assert "usage.input_tokens" in missing.value.body["message"]


def test_a_whole_reply_is_read_in_stretches_that_end_at_closing_markers():
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    reply = ChatReply(
        ReasoningReader("qwen3", False),
        tool_call_format("hermes"),
        ToolPlan(tools, (), parallel=True),
    )
    text = f"<think>hm</think>\n\nlet me see.\n{CALL_TEXT}\n{CALL_TEXT}\nthat is all."
    said = [
        (p.thinking, p.content, [c["function"]["name"] for c in p.calls])
        for p in reply.ordered(text, "stop")
        if p.thinking or p.content or p.calls
    ]
    assert said == [
        ("hm", "", []),
        ("", "let me see.", ["get_weather"]),
        ("", "", ["get_weather"]),
        ("", "\nthat is all.", []),
    ]


@pytest.mark.parametrize("cut", [len("let me see.\n") + len(CALL_TEXT) - 5, len(CALL_TEXT) + 14])
def test_a_streamed_piece_holding_a_calls_end_and_text_after_it_is_split_there(cut):
    """A marker split between two pieces still splits the second one where it ends: text,
    then the call, then the text after it (text pieces in a row joined)."""
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    reply = ChatReply(None, tool_call_format("hermes"), ToolPlan(tools, (), parallel=True))
    said: list = []
    for piece in [*reply.feed_ordered(SAID[:cut]), *reply.feed_ordered(SAID[cut:])]:
        if piece.content:
            if said and said[-1][0] == "text":
                said[-1] = ("text", said[-1][1] + piece.content)
            else:
                said.append(("text", piece.content))
        said += [("call", call["function"]["name"]) for call in piece.calls]
    assert said == [("text", "let me see."), ("call", "get_weather"), ("text", "\nthat is all.")]
