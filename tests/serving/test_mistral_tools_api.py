"""Tool calling with Mistral's format through /v1/chat/completions, on a model whose tokenizer
has ``[TOOL_CALLS]`` and ``[ARGS]`` as special tokens, as Mistral's have: the grammar names the
marker by its token, the request's text keeps it (``skip_special_tokens`` off), the reply is
read into ``tool_calls`` with 9-character ids, and a history with OpenAI's ids renders through a
template that takes no other (Mistral's raise). Both formats: before v11 (one marker, a JSON
list of calls) and v11 (a marker, the name and ``[ARGS]`` per call)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import AddedToken

from osd.testing import char_tokenizer, save_toy_pair
from tests.reliability.conftest import Replica, running_replica, toy_config
from tests.serving.test_tools_api import ASK, TOOLS, follows_schema, streamed_calls

_IDS_CHECKED = (
    "{%- if c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{% endif %}"
)
_HEAD = (
    "{%- if tools -%}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n"
    "{% endif -%}{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if m.tool_call_id|length != 9 %}{{ raise_exception('bad id') }}{% endif -%}"
    "result: {{ m.content }}\n"
    "{%- elif m.tool_calls -%}"
)
_TAIL = (
    "{%- else -%}{{ m.role }}: {{ m.content or '' }}\n{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}assistant: {% endif -%}"
)
TEMPLATES = {
    # Mistral 7B v0.3's shape: [TOOL_CALLS] [{"name", "arguments", "id"}, ...]
    "v3": _HEAD
    + "[TOOL_CALLS] [{%- for c in m.tool_calls -%}"
    + _IDS_CHECKED
    + "{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id}|tojson }}"
    + "{% if not loop.last %}, {% endif %}{% endfor %}]<eos>\n"
    + _TAIL,
    # Mistral Small 3.2's: [TOOL_CALLS]name[ARGS]{...} per call.
    "v11": _HEAD
    + "{%- for c in m.tool_calls -%}"
    + _IDS_CHECKED
    + "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments|tojson }}"
    + "{% endfor %}<eos>\n"
    + _TAIL,
}


def _mistral_models(root: Path, template: str) -> tuple[Path, Path]:
    """A toy pair whose tokenizer adds Mistral's markers as special tokens (ids 64, 65)."""
    tokenizer = char_tokenizer()
    tokenizer.add_tokens(
        [AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)],
        special_tokens=True,
    )
    tokenizer.chat_template = template
    return save_toy_pair(root, tokenizer)


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def replica(request, tmp_path_factory) -> Iterator[Replica]:
    target, draft = _mistral_models(
        tmp_path_factory.mktemp(request.param), TEMPLATES[request.param]
    )
    config = toy_config(
        "serve.max_tokens_limit=160", f"model.target={target}", f"model.draft={draft}"
    )
    with running_replica(config) as replica:
        assert replica.runtime.tool_parser == "mistral"  # detected from the template
        yield replica


def chat(client, **fields):
    fields.setdefault("max_tokens", 150)
    return client.chat.completions.create(
        model="osd", messages=fields.pop("messages", ASK), **fields
    )


def test_required_calls_an_offered_tool_through_the_special_marker(client):
    for seed in range(3):
        choice = chat(client, tools=TOOLS, tool_choice="required", seed=seed).choices[0]
        assert choice.finish_reason in ("tool_calls", "length"), choice
        assert choice.message.tool_calls and choice.message.content is None, choice
        for call in choice.message.tool_calls:
            assert len(call.id) == 9 and call.id.isalnum(), call.id  # Mistral's ids
            assert follows_schema(call), call


def test_a_named_function_streamed_equals_the_whole_answer(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, tools=TOOLS, tool_choice=named, seed=3).choices[0]
    content, calls, finish = streamed_calls(client, tools=TOOLS, tool_choice=named, seed=3)
    assert finish == whole.finish_reason == "stop"
    assert content == (whole.message.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [name for name, _ in calls] == ["get_weather"]


def test_a_history_with_openai_ids_renders_for_a_template_that_takes_nine_characters(client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_7f3a9c0e1b2d4e5f6a7b8c9d",  # OpenAI's shape: 29 characters
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_7f3a9c0e1b2d4e5f6a7b8c9d", "content": "sunny"},
    ]
    answer = chat(client, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_skip_special_tokens_false_writes_special_tokens_in_the_text(replica):
    # The marker's logit raised: the toy model writes it over and over.
    fields = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "logit_bias": {"64": 100}}
    skipped = replica.complete(**fields).json()["choices"][0]["text"]
    written = replica.complete(**fields, skip_special_tokens=False).json()["choices"][0]["text"]
    assert skipped == "" and written == "[TOOL_CALLS]" * 3
    # null is the default, as for every field.
    default = replica.complete(**fields, skip_special_tokens=None).json()["choices"][0]["text"]
    assert default == skipped


def test_a_reply_with_the_marker_in_auto_is_read_as_calls(client, replica):
    # auto: the model's own text is read; a grammar makes the toy model write text and a
    # call, its markers the special tokens (a grammar names a token by its id).
    form = replica.runtime.tool_format
    assert dict(form.marker_ids)["[TOOL_CALLS]"] == 64
    arguments = json.dumps(json.dumps({"city": "oslo"}))
    if form.arguments_marker is None:  # v3
        call = json.dumps(' [{"name": "get_weather", "arguments": {"city": "oslo"}}]')
    else:
        call = f'"get_weather" <[65]> {arguments}'
    grammar = f'start: "let me see. " <[64]> {call}'
    choice = chat(
        client, tools=TOOLS, extra_body={"structured_outputs": {"grammar": grammar}}
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "let me see."
    [made] = choice.message.tool_calls
    assert (made.function.name, json.loads(made.function.arguments)) == (
        "get_weather",
        {"city": "oslo"},
    )
