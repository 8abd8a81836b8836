"""Tool calling with DeepSeek V3.1's and Kimi K2's calls through /v1/chat/completions, on models
whose tokenizers add the markers as their own tokens: DeepSeek's as added tokens that are not
special, Kimi's as special ones (as theirs are). The parser is detected from the template; a
forced call writes the markers by their ids and reads back as the tools' calls, streamed equal
to whole; Kimi's calls carry its ``functions.name:N`` ids; a history's calls render through
DeepSeek's template, which joins an earlier call's arguments as text."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import AddedToken

from osd.testing import char_tokenizer, save_toy_pair
from tests.reliability.conftest import Replica, running_replica, toy_config
from tests.serving.test_section_tool_parsers import (
    CALL,
    CALL_END,
    CALLS,
    CALLS_END,
    KIMI_ARGUMENTS,
    KIMI_CALL,
    KIMI_END,
    SECTION,
    SECTION_END,
    SEP,
)
from tests.serving.test_tools_api import (
    ASK,
    TOOLS,
    chat,
    named_call_streams_as_whole,
    required_calls_follow_schema,
)

_HEAD = (
    "{%- if tools -%}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n"
    "{% endif -%}{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}result: {{ m.content }}\n"
    "{%- elif m.tool_calls -%}assistant: {{ m.content or '' }}"
)
_TAIL = (
    "<eos>\n{%- else -%}{{ m.role }}: {{ m.content or '' }}\n{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}assistant: {% endif -%}"
)
FAMILIES = {
    # DeepSeek V3.1's: the arguments joined as text (an object would fail the template).
    "deepseek_v31": (
        (CALLS, CALLS_END, CALL, CALL_END, SEP),
        False,
        _HEAD
        + f"{CALLS}{{%- for c in m.tool_calls -%}}"
        + f"{{{{ '{CALL}' + c.function.name + '{SEP}' + c.function.arguments + '{CALL_END}' }}}}"
        + f"{{%- endfor -%}}{CALLS_END}"
        + _TAIL,
    ),
    # Kimi K2's: each call's id as its header, the arguments with tojson.
    "kimi_k2": (
        (SECTION, SECTION_END, KIMI_CALL, KIMI_END, KIMI_ARGUMENTS),
        True,
        _HEAD
        + f"{SECTION}{{%- for c in m.tool_calls -%}}"
        + f"{KIMI_CALL}{{{{ c.id }}}}{KIMI_ARGUMENTS}{{{{ c.function.arguments | tojson }}}}"
        + f"{KIMI_END}{{%- endfor -%}}{SECTION_END}"
        + _TAIL,
    ),
}


def _models(root: Path, markers: tuple[str, ...], special: bool, template: str):
    tokenizer = char_tokenizer()
    tokenizer.add_tokens([AddedToken(m, special=special) for m in markers], special_tokens=special)
    tokenizer.chat_template = template
    return save_toy_pair(root, tokenizer)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def replica(request, tmp_path_factory) -> Iterator[Replica]:
    markers, special, template = FAMILIES[request.param]
    target, draft = _models(tmp_path_factory.mktemp(request.param), markers, special, template)
    config = toy_config(
        "serve.max_tokens_limit=160", f"model.target={target}", f"model.draft={draft}"
    )
    with running_replica(config) as replica:
        assert replica.runtime.tool_parser == request.param  # detected from the template
        yield replica


def _ids_are_the_formats(replica, calls) -> bool:
    if replica.runtime.tool_parser != "kimi_k2":
        return all(call.id.startswith("call_") for call in calls)
    return all(re.fullmatch(rf"functions\.{c.function.name}:\d+", c.id) for c in calls)


def test_required_calls_an_offered_tool_through_the_markers(client, replica):
    calls = required_calls_follow_schema(client)  # (the toy model may call on until max_tokens)
    assert _ids_are_the_formats(replica, calls)


@pytest.mark.parametrize("method", ["token", "block"])
def test_a_named_function_streamed_equals_the_whole_answer(client, method):
    named_call_streams_as_whole(client, "calc", method, seed=2)


def test_a_history_of_calls_renders_and_is_answered(client, replica):
    call_id = "functions.get_weather:0" if replica.runtime.tool_parser == "kimi_k2" else "call_1"
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]
    answer = chat(client, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The template wrote the call as the model writes one.
    tokens = replica.client.post("/tokenize", json={"messages": history}).json()["tokens"]
    prompt = replica.client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    marker = KIMI_CALL if replica.runtime.tool_parser == "kimi_k2" else CALL
    assert (
        f"{marker}{'functions.get_weather:0' if marker == KIMI_CALL else 'get_weather'}" in prompt
    )
    assert '{"city": "oslo"}' in prompt
