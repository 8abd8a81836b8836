"""gpt-oss's harmony through /v1/chat/completions, on a toy pair whose tokenizer has harmony's
markers as special tokens and whose generation config ends a reply at ``<|return|>`` and
``<|call|>``: the analysis channel is the message's reasoning, the final channel its content, a
commentary message to a function a tool call, whole and streamed alike; the markers never reach
the client; a forced call follows the schema."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import AddedToken

from osd.testing import char_tokenizer, save_toy_pair
from serving.harmony import HARMONY_MARKERS
from tests.reliability.conftest import Replica, running_replica, toy_config
from tests.serving.test_reasoning_api import JSON_ANSWER, streamed
from tests.serving.test_responses_api import whole_and_streamed
from tests.serving.test_tools_api import ASK, TOOLS, chat, follows_schema

TEMPLATE = (
    "{%- if tools -%}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n"
    "{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}"
    "{{- '<|start|>assistant to=functions.' + c.function.name + '<|channel|>commentary json"
    "<|message|>' }}{{- c.function.arguments | tojson }}{{- '<|call|>' }}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{- '<|start|>' + m.role + '<|message|>' + (m.content or '') + '<|end|>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{% endif -%}"
    "{%- if reasoning_effort is defined %}{{ reasoning_effort }}{% endif -%}"
)


def harmony_tokenizer():
    """The toy tokenizer with harmony's markers as special tokens (ids 64 on)."""
    tokenizer = char_tokenizer()
    tokenizer.add_tokens(
        [AddedToken(m, special=True) for m in HARMONY_MARKERS], special_tokens=True
    )
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _models(root: Path) -> tuple[Path, Path]:
    tokenizer = harmony_tokenizer()
    # A reply ends at <|return|> (the tokenizer's end) and at <|call|>, which some of gpt-oss's
    # generation configs leave out: the replica adds it.
    tokenizer.eos_token = "<|return|>"
    return save_toy_pair(root, tokenizer, ends=[tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Iterator[Replica]:
    target, draft = _models(tmp_path_factory.mktemp("harmony"))
    config = toy_config(
        "serve.max_tokens_limit=160", f"model.target={target}", f"model.draft={draft}"
    )
    with running_replica(config) as replica:
        runtime = replica.runtime
        assert (runtime.tool_parser, runtime.reasoning_parser) == ("openai", "openai_gptoss")
        ends = runtime.tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
        assert set(ends) <= set(runtime.engine.eos_token_ids)
        yield replica


def harmony(replica, text: str) -> dict:
    """Fields that make the toy model write ``text``, its markers as their special tokens."""
    tokenizer = replica.runtime.tokenizer
    parts = [
        f"<[{tokenizer.convert_tokens_to_ids(piece)}]>"
        if piece in HARMONY_MARKERS
        else json.dumps(piece)
        for piece in _MARKER.split(text)
        if piece
    ]
    return {"extra_body": {"structured_outputs": {"grammar": "start: " + " ".join(parts)}}}


_MARKER = re.compile("(" + "|".join(re.escape(m) for m in HARMONY_MARKERS) + ")")


REPLY = (
    "<|channel|>analysis<|message|>2 < 3, so.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>yes."
)


def test_analysis_is_the_reasoning_and_final_the_content_whole_and_streamed(client, replica):
    fields = harmony(replica, REPLY)
    choice = chat(client, **fields).choices[0]
    assert (choice.message.model_extra or {})["reasoning"] == "2 < 3, so."
    assert choice.message.content == "yes."
    assert streamed(client, **fields)[:2] == ("2 < 3, so.", "yes.")


def test_a_call_to_a_function_is_a_tool_call(client, replica):
    call = (
        "<|channel|>analysis<|message|>look.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.calc <|constrain|>json<|message|>{"n": 4}'
    )
    choice = chat(client, tools=TOOLS, **harmony(replica, call)).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [made] = choice.message.tool_calls
    assert (made.function.name, json.loads(made.function.arguments)) == ("calc", {"n": 4})
    thinking, content, calls, finish = streamed(client, tools=TOOLS, **harmony(replica, call))
    assert (thinking, content, finish) == ("look.", "", "tool_calls")
    assert [c.function.name for c in calls] == ["calc"]


def test_a_forced_call_follows_the_schema_and_a_history_renders(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(2):
        choice = chat(client, tools=TOOLS, tool_choice=named, seed=seed).choices[0]
        [made] = choice.message.tool_calls
        assert follows_schema(made) and choice.finish_reason == "stop"
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
        {"role": "tool", "tool_call_id": made.id, "content": "sunny"},
    ]
    # The history renders (gpt-oss's template takes the call's arguments as an object).
    answer = chat(client, messages=history, tools=TOOLS, max_tokens=3).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")


def test_the_models_own_words_never_show_the_markers(client):
    choice = chat(client, max_tokens=20, seed=4, temperature=1.0).choices[0]
    text = (choice.message.content or "") + ((choice.message.model_extra or {})["reasoning"] or "")
    assert "<|" not in text


def test_reasoning_effort_reaches_a_template_that_takes_it(client):
    def prompt_tokens(**fields) -> int:
        return chat(client, max_tokens=1, **fields).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(reasoning_effort="high") == plain + len("high")
    assert prompt_tokens(reasoning_effort="low") == plain + len("low")


def test_structured_output_is_the_final_channel_after_an_analysis(client):
    # As vLLM applies a grammar to gpt-oss's final channel: an analysis may come first (the toy
    # model made to end it at once: <|end|>'s logit raised), then the schema's JSON.
    fields = {**JSON_ANSWER, "logit_bias": {"65": 30}}  # <|end|>
    for seed in range(3):
        choice = chat(client, seed=seed, logprobs=True, **fields).choices[0]
        assert choice.logprobs.content[0].token == "<|channel|>"  # harmony's, not the JSON's
        assert set(json.loads(choice.message.content)) == {"a"}, choice
        assert "<|" not in ((choice.message.model_extra or {})["reasoning"] or "")


def test_the_responses_api_gives_the_analysis_then_the_final_message(client, replica):
    fields = {"input": "is 2 < 3?", "max_output_tokens": 150, **harmony(replica, REPLY)}
    for response in whole_and_streamed(client, **fields):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "2 < 3, so."
        assert response.output_text == "yes."
