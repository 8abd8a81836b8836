"""Tool calling with Qwen3-Coder's XML calls through /v1/chat/completions: the parser is detected
from the chat template, a forced call follows the tools' schemas under speculation and reads
back typed, streamed calls equal the whole answer, and a history's calls render."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.reliability.conftest import Replica
from tests.serving.test_qwen3_coder_tool_parser import TEMPLATE
from tests.serving.test_tools_api import (
    TOOLS,
    call_history,
    chat,
    follows_schema,
    named_call_streams_as_whole,
    template_replica,
)


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with template_replica(TEMPLATE, "qwen3_coder") as replica:  # the parser from the template
        yield replica


def test_required_calls_an_offered_tool_with_typed_valid_arguments(client):
    for seed in range(4):
        choice = chat(
            client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed
        ).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert choice.message.content is None and call.id.startswith("call_")
        assert follows_schema(call), call  # calc's n is a JSON integer, not its text


@pytest.mark.parametrize("method", ["token", "block", "spectr"])
def test_a_named_function_streamed_equals_the_whole_answer(client, method):
    named_call_streams_as_whole(client, "get_weather", method)


def test_a_reply_with_a_call_in_auto_is_read_as_typed_calls(client):
    # auto: the model's own text is read; a grammar makes the toy model write text and a call.
    call = (
        "<tool_call>\n<function=calc>\n<parameter=n>\n42\n</parameter>\n</function>\n</tool_call>"
    )
    grammar = f"start: {json.dumps('let me see. ' + call)}"
    choice = chat(
        client, tools=TOOLS, extra_body={"structured_outputs": {"grammar": grammar}}
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "let me see."
    [made] = choice.message.tool_calls
    assert (made.function.name, json.loads(made.function.arguments)) == ("calc", {"n": 42})


def test_a_history_with_calls_renders(client):
    history = call_history("calc", '{"n": 7}', "49")
    answer = chat(client, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
