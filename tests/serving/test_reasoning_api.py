"""A reasoning model's thinking through /v1/chat/completions: read apart as the message's
``reasoning`` (and ``reasoning_content``) whole and streamed alike, left out with
``include_reasoning: false``, turned off by ``chat_template_kwargs`` (Qwen3's
``enable_thinking``), tool calls read from the answer alone, and a history's thinking given to
the template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tokenizers import AddedToken

from osd.testing import char_tokenizer, save_toy_pair
from tests.reliability.conftest import Replica, running_replica, toy_config
from tests.serving.test_responses_api import whole_and_streamed
from tests.serving.test_tools_api import ASK, TOOLS, chat

# Qwen3's way, in the toy tokenizer's alphabet: with enable_thinking the generation prompt opens
# <think> (as Qwen3's thinking models' templates do), with it false it closes an empty one,
# without it the reply opens its own (Qwen3's hybrids); hermes calls; earlier thinking shown.
TEMPLATE = (
    "{%- if tools -%}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n"
    "{% endif -%}"
    "{%- for m in messages -%}{{ m.role }}: "
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif -%}"
    "{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n"
    "</tool_call>{% endfor %}\n{% endfor -%}"
    "{%- if add_generation_prompt %}{{ 'assistant: ' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}"
    "{%- elif enable_thinking is defined %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif -%}"
)
THINKING = {"enable_thinking": True}  # chat_template_kwargs: the prompt opens <think>
REPLY = "<think>\nfirst, 2 < 3.\n</think>\n\nthe answer."


def _models(root: Path, special: bool) -> tuple[Path, Path]:
    """A toy pair whose tokenizer has ``</think>`` as one token, id 64: an ordinary one, as
    Qwen3's, or a special one, as some reasoning models' (read in the text all the same)."""
    tokenizer = char_tokenizer()
    tokenizer.add_tokens([AddedToken("</think>", special=special)], special_tokens=special)
    return save_toy_pair(root, tokenizer)


@pytest.fixture(scope="module", params=[False, True], ids=["ordinary", "special"])
def replica(request, tmp_path_factory) -> Iterator[Replica]:
    target, draft = _models(tmp_path_factory.mktemp("thinking"), special=request.param)
    config = toy_config(
        "serve.max_tokens_limit=160",
        f"model.target={target}",
        f"model.draft={draft}",
        f"model.chat_template={json.dumps(TEMPLATE)}",
    )
    with running_replica(config) as replica:
        assert replica.runtime.reasoning_parser == "qwen3"  # detected from the template
        yield replica


def written(text: str) -> dict:
    """Request fields that make the toy model write ``text`` (a grammar of that text)."""
    return {"extra_body": {"structured_outputs": {"grammar": f"start: {json.dumps(text)}"}}}


def streamed(client, **fields) -> tuple[str, str, list, str | None]:
    """(reasoning, content, tool_calls deltas, finish_reason) of one streamed choice."""
    thinking, content, calls, finish = "", "", [], None
    for chunk in chat(client, stream=True, **fields):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        thinking += extra.get("reasoning") or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return thinking, content, calls, finish


def test_thinking_is_the_reasoning_whole_and_streamed_alike(client):
    choice = chat(client, **written(REPLY)).choices[0]
    message = choice.message.model_extra or {}
    assert (message["reasoning"], choice.message.content) == ("first, 2 < 3.", "the answer.")
    assert message["reasoning_content"] == message["reasoning"]
    thinking, content, _, finish = streamed(client, **written(REPLY))
    assert (thinking, content, finish) == ("first, 2 < 3.", "the answer.", choice.finish_reason)


def test_include_reasoning_false_leaves_the_thinking_out(client):
    fields = written(REPLY)
    fields["extra_body"]["include_reasoning"] = False
    choice = chat(client, **fields).choices[0]
    assert (choice.message.model_extra or {})["reasoning"] is None
    assert choice.message.content == "the answer."
    assert streamed(client, **fields)[:2] == ("", "the answer.")


def test_a_prompt_that_opened_thinking_makes_the_reply_thinking_unless_enable_thinking_false(
    client, replica
):
    # The toy model's own words (no grammar): the prompt opened <think>, which it never closes.
    thinking = {
        "max_tokens": 12,
        "seed": 2,
        "temperature": 1.0,
        "logit_bias": {"64": -100},  # never </think>
        "extra_body": {"chat_template_kwargs": THINKING},
    }
    choice = chat(client, **thinking).choices[0]
    reasoning = (choice.message.model_extra or {})["reasoning"]
    assert choice.message.content is None and reasoning and "</think>" not in reasoning
    _, content, _, _ = streamed(client, **thinking)
    assert content == ""
    off = {**thinking, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    choice = chat(client, **off).choices[0]
    assert choice.message.content and (choice.message.model_extra or {})["reasoning"] is None
    # /tokenize renders the chat as the endpoint does.
    ids = replica.client.post(
        "/tokenize", json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    ).json()["tokens"]
    assert replica.runtime.tokenizer.decode(ids).endswith("<think>\n\n</think>\n\n")


def test_a_template_argument_the_server_sets_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        chat(client, extra_body={"chat_template_kwargs": {"tools": []}})


def test_tool_calls_are_read_from_the_answer_not_the_thinking(client):
    call = '<tool_call>\n{"name": "calc", "arguments": {"n": 7}}\n</tool_call>'
    reply = f"<think>maybe {call} no.\n</think>\n\n{call}"
    choice = chat(client, tools=TOOLS, max_tokens=160, **written(reply)).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert (choice.message.model_extra or {})["reasoning"] == f"maybe {call} no."
    [made] = choice.message.tool_calls
    assert (made.function.name, json.loads(made.function.arguments)) == ("calc", {"n": 7})
    thinking, content, calls, finish = streamed(
        client, tools=TOOLS, max_tokens=160, **written(reply)
    )
    assert (thinking, content, finish) == (f"maybe {call} no.", "", "tool_calls")
    assert [c.function.name for c in calls] == ["calc"]


def test_a_history_with_thinking_renders_it_under_either_name(replica):
    for name in ("reasoning", "reasoning_content"):
        messages = [*ASK, {"role": "assistant", "content": "sunny.", name: "look it up"}, *ASK]
        ids = replica.client.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert "assistant:<think>look it up</think>sunny." in replica.runtime.tokenizer.decode(ids)


SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
JSON_ANSWER = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
}


def test_a_grammar_holds_after_the_thinking_an_opened_prompt_asks_for(client):
    # As vLLM applies a grammar after reasoning: thinking first, free, then the grammar's
    # answer. The toy model made to end its thinking at once (</think>'s logit raised).
    fields = {"seed": 3, "logit_bias": {"64": 30}, "extra_body": {"chat_template_kwargs": THINKING}}
    choice = chat(client, **JSON_ANSWER, **fields, logprobs=True).choices[0]
    assert choice.logprobs.content[0].token == "</think>"  # the grammar let it think first
    assert (choice.message.model_extra or {})["reasoning"] is None  # it thought nothing
    assert set(json.loads(choice.message.content)) == {"a"}
    assert streamed(client, **JSON_ANSWER, **fields)[1] == choice.message.content
    named = {"type": "function", "function": {"name": "calc"}}
    choice = chat(client, tools=TOOLS, tool_choice=named, **fields).choices[0]
    [made] = choice.message.tool_calls
    assert made.function.name == "calc" and set(json.loads(made.function.arguments)) == {"n"}


def test_where_the_prompt_opens_no_thinking_a_grammar_writes_the_whole_answer(client):
    choice = chat(client, seed=3, **JSON_ANSWER).choices[0]
    assert (choice.message.model_extra or {})["reasoning"] is None
    assert set(json.loads(choice.message.content)) == {"a"}
    named = {"type": "function", "function": {"name": "calc"}}
    [made] = chat(client, tools=TOOLS, tool_choice=named, seed=1).choices[0].message.tool_calls
    assert made.function.name == "calc" and set(json.loads(made.function.arguments)) == {"n"}


def test_the_responses_api_answers_the_thinking_as_a_reasoning_item(client):
    fields = {"input": "weather in oslo?", "max_output_tokens": 150, **written(REPLY)}
    for response in whole_and_streamed(client, **fields):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "first, 2 < 3."
        assert response.output_text == "the answer." and response.status == "completed"
