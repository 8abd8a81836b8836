"""A Gemma 4 model through /v1/chat/completions, its markers special tokens of its tokenizer (as
Gemma's are): the tool-call format and the reasoning parser are detected from the template; a
forced call is written in Gemma's notation and reads back as the tools' calls, streamed equal
to whole; a reply that thinks in Gemma's channel and then calls is read apart into reasoning
and calls, and ends at ``<|tool_response>``; a history of calls renders in Gemma's notation."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import AddedToken

from osd.testing import char_tokenizer, save_toy_pair
from tests.reliability.conftest import Replica, running_replica, toy_config
from tests.serving.test_reasoning_api import streamed
from tests.serving.test_tools_api import (
    TOOLS,
    call_history,
    chat,
    named_call_streams_as_whole,
    required_calls_follow_schema,
)

MARKERS = (
    "<|turn>",
    "<turn|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
    "<|channel>",
    "<channel|>",
)
# Gemma 4's way, shortened: arguments in its notation (keys sorted, strings quoted), the
# answers of the tools after <|tool_response>, thinking in the channel the reply opens.
TEMPLATE = (
    "{%- macro arg(v) -%}"
    '{%- if v is string -%}<|"|>{{ v }}<|"|>'
    "{%- elif v is boolean -%}{{ 'true' if v else 'false' }}"
    "{%- elif v is mapping -%}{ {%- for k, x in v | dictsort -%}{{ k }}:{{ arg(x) }}"
    "{{ ',' if not loop.last }}{%- endfor -%} }"
    "{%- elif v is sequence -%}[{%- for x in v -%}{{ arg(x) }}{{ ',' if not loop.last }}"
    "{%- endfor -%}]"
    "{%- else -%}{{ v }}{%- endif -%}{%- endmacro -%}"
    "{%- if tools -%}<|turn>system\n{%- for t in tools -%}<|tool>declaration:"
    "{{ t.function.name }}<tool|>{%- endfor -%}<turn|>\n{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}<|tool_response>response:{value:{{ arg(m.content) }}}"
    "<tool_response|>"
    "{%- else -%}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{%- if m.reasoning %}<|channel>thought\n{{ m.reasoning }}\n<channel|>{% endif -%}"
    "{%- for c in m.tool_calls or [] -%}<|tool_call>call:{{ c.function.name }}"
    "{{ arg(c.function.arguments) }}<tool_call|>{%- endfor -%}"
    "{{ m.content or '' }}<turn|>\n{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}<|turn>model\n{% endif -%}"
)


def _models(root: Path) -> tuple[Path, Path]:
    tokenizer = char_tokenizer()
    tokenizer.add_tokens([AddedToken(m, special=True) for m in MARKERS], special_tokens=True)
    tokenizer.chat_template = TEMPLATE
    return save_toy_pair(root, tokenizer)


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Iterator[Replica]:
    target, draft = _models(tmp_path_factory.mktemp("gemma"))
    config = toy_config(
        "serve.max_tokens_limit=160", f"model.target={target}", f"model.draft={draft}"
    )
    with running_replica(config) as replica:
        assert replica.runtime.tool_parser == "gemma4"  # detected from the template
        assert replica.runtime.reasoning_parser == "gemma4"
        yield replica


def written(replica: Replica, text: str) -> dict:
    """Request fields that make the toy model write ``text``, its markers as their tokens."""
    vocab = replica.runtime.tokenizer.get_added_vocab()
    pattern = "|".join(re.escape(m) for m in MARKERS)
    parts = [
        f"<[{vocab[piece]}]>" if piece in MARKERS else json.dumps(piece)
        for piece in re.split(f"({pattern})", text)
        if piece
    ]
    return {"extra_body": {"structured_outputs": {"grammar": "start: " + " ".join(parts)}}}


def test_required_calls_an_offered_tool_in_gemmas_notation(client):
    calls = required_calls_follow_schema(client)
    assert all(call.id.startswith("call_") for call in calls)


@pytest.mark.parametrize("method", ["token", "block"])
def test_a_named_function_streamed_equals_the_whole_answer(client, method):
    named_call_streams_as_whole(client, "get_weather", method, seed=2)


def test_thinking_then_calls_read_apart_and_ended_at_the_tool_response(client, replica):
    reply = "<|channel>thought\nmaybe calc.<channel|><|tool_call>call:calc{n:7}<tool_call|>"
    fields = {"tools": TOOLS, "max_tokens": 160, **written(replica, reply + "<|tool_response>")}
    choice = chat(client, **fields).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert (choice.message.model_extra or {})["reasoning"] == "maybe calc."
    [made] = choice.message.tool_calls
    assert (made.function.name, json.loads(made.function.arguments)) == ("calc", {"n": 7})
    thinking, content, calls, finish = streamed(client, **fields)
    assert (thinking, content, finish) == ("maybe calc.", "", "tool_calls")
    assert [c.function.name for c in calls] == ["calc"]
    # Without tools the channel is read all the same; the answer is the rest.
    plain = chat(client, **written(replica, "<|channel>thought\nhm<channel|>fine.")).choices[0]
    assert ((plain.message.model_extra or {})["reasoning"], plain.message.content) == (
        "hm",
        "fine.",
    )


def test_a_history_of_calls_renders_in_gemmas_notation(client, replica):
    history = call_history("get_weather", '{"unit": "c", "city": "oslo"}', "sunny")
    answer = chat(client, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokens = replica.client.post("/tokenize", json={"messages": history}).json()["tokens"]
    prompt = replica.runtime.tokenizer.decode(tokens)
    assert (
        '<|tool_call>call:get_weather{city:<|"|>oslo<|"|>,unit:<|"|>c<|"|>}<tool_call|>' in prompt
    )
