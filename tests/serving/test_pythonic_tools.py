"""Pythonic tool calls (serving.tool_parsers, ``pythonic`` / ``llama4_pythonic``: Llama 3.2
and 4 with such templates, ToolACE): a reply that is ``[name(key=value, ...), ...]`` read as
calls, values as Python literals (and JSON's ``true`` / ``null``); any other reply is text; the
grammar writes the keyword arguments in the schema's order with Python's literals; and through
/v1/chat/completions."""

from __future__ import annotations

import string
from collections.abc import Iterator

import openai
import pytest

from osd.decode.grammar import GrammarCompiler
from osd.toy_models import char_tokenizer
from serving.tool_parsers import ParsedCall, detect_parser, tool_call_format
from tests.reliability.conftest import Replica
from tests.serving.test_tool_parsers import ONE_PLUS_TWO, OSLO, scan
from tests.serving.test_tools_api import (
    chat,
    named_call_streams_as_whole,
    required_calls_follow_schema,
    template_replica,
)

CASES = [
    ("The weather is fine.", None),
    ("[get_weather(city='Oslo'), calc(expression=\"1 + 2\")]", ("", [OSLO, ONE_PLUS_TWO])),
    # Llama 4's markers around the list.
    ("<|python_start|>[get_weather(city='Oslo')]<|python_end|>", ("", [OSLO])),
    # Values: Python's and JSON's constants, tuples as lists, numbers as written.
    (
        '[calc(x=[1, True, None, (2, 3)], y=-2.50, z={"a": false}, w=1e999)]',
        (
            "",
            [
                ParsedCall(
                    "calc",
                    '{"x": [1, true, null, [2, 3]], "y": -2.50, "z": {"a": false}, "w": 1e999}',
                )
            ],
        ),
    ),
    # Not calls: text first, a list of other things, an unknown function, a positional
    # argument, a repeated key, a name that is no literal, an unfinished list.
    ("Sure: [calc()]", None),
    ("[1, 2] are numbers", None),
    ("[rm(path='/')]", None),
    ("[calc(1)]", None),
    ("[calc(x=1, x=2)]", None),
    ("[calc(x=os.system)]", None),
    ("[calc(x=1", None),
    (" [Note] the list [1, 2] ", None),  # (streams once it cannot be calls, spaces kept)
    ("[calc(x=--1.5, y=-1)]", ("", [ParsedCall("calc", '{"x": 1.5, "y": -1}')])),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
@pytest.mark.parametrize("pieces", [0, 1, 5])
@pytest.mark.parametrize("parser", ["pythonic", "llama4_pythonic"])
def test_pythonic_replies_read_alike_whole_and_in_pieces(parser, text, expected, pieces):
    assert scan(parser, text, pieces) == (expected or (text, []))


def test_a_reply_that_cannot_be_calls_streams_from_there():
    from serving.tool_parsers import ToolCallScanner

    scanner = ToolCallScanner("pythonic", ["calc"])
    assert scanner.feed(" [No") == ("", [])  # may still be [Now(...)]
    assert scanner.feed("te] one") == (" [Note] one", [])
    assert scanner.feed(" two") == (" two", []) and scanner.finish() == ("", [])
    calls = ToolCallScanner("pythonic", ["calc"])
    assert calls.feed("[calc(") == ("", []) and calls.feed("x=1)]") == ("", [])
    assert calls.finish() == ("", [ParsedCall("calc", '{"x": 1}')])


FUNCTIONS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["unit"],
        },
    },
    {"name": "calc"},
]


def test_grammars_write_keyword_arguments_in_order_as_python_literals():
    tokenizer = char_tokenizer(string.ascii_letters + string.digits + ' ,="()[]_')  # (capitals)
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    source = tool_call_format("pythonic").grammar(FUNCTIONS, parallel=True)

    def accepts(text: str) -> bool:
        matcher = compiler.compile("lark", source).matcher()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())

    good = [
        '[get_weather(unit="c")]',
        '[get_weather(city="oslo", unit="f")]',
        '[get_weather(days=3, metric=False, unit="c"), calc()]',
    ]
    bad = [
        "[get_weather()]",  # unit is required
        '[get_weather(unit="c", city="oslo")]',  # not the schema's order
        '[get_weather(metric=false, unit="c")]',  # Python's False
        '[get_weather(, unit="c")]',
        "[rm()]",
    ]
    assert all(accepts(text) for text in good) and not any(accepts(text) for text in bad)
    assert [c.name for c in scan("pythonic", good[2])[1]] == ["get_weather", "calc"]
    assert detect_parser("Respond as [func_name1(params_name1=params_value1)]") == "pythonic"


def test_many_optional_parameters_compile_flat():
    properties = {f"p{i}": {"type": "integer"} for i in range(150)}
    source = tool_call_format("pythonic").grammar(
        [{"name": "f", "parameters": {"type": "object", "properties": properties}}], False
    )
    compiler = GrammarCompiler(char_tokenizer(), 64)
    matcher = compiler.compile("lark", source).matcher()
    ids = char_tokenizer()("[f(p7=1, p149=2)]", add_special_tokens=False)["input_ids"]
    assert matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize(
    "function",
    [
        {"name": "get-weather"},
        {
            "name": "send",
            "parameters": {"type": "object", "properties": {"from": {"type": "string"}}},
        },
    ],
)
def test_names_python_cannot_write_are_refused_for_a_forced_call(function):
    with pytest.raises(ValueError, match="not a Python identifier"):
        tool_call_format("pythonic").grammar([function], False)


TEMPLATE = (
    "{%- if tools -%}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n"
    "reply as [func_name1(params_name1=params_value1)]\n{% endif -%}"
    "{%- for m in messages -%}{{ m.role }}: {{ m.content or '' }}"
    "{%- if m.tool_calls -%}[{%- for c in m.tool_calls -%}{{ c.function.name }}("
    "{%- for k, v in c.function.arguments.items() -%}{{ k }}={{ v | tojson }}"
    "{%- if not loop.last %}, {% endif %}{%- endfor -%}){%- if not loop.last %}, {% endif %}"
    "{%- endfor -%}]{%- endif %}\n{% endfor -%}"
    "{%- if add_generation_prompt %}assistant: {% endif -%}"
)


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with template_replica(TEMPLATE, "pythonic") as replica:
        yield replica


def test_required_calls_offered_tools_with_valid_arguments(client):
    required_calls_follow_schema(client)


def test_a_named_function_streamed_equals_the_whole_answer(client):
    named_call_streams_as_whole(client, "calc", "block")


def test_a_forced_call_of_a_name_python_cannot_write_is_a_400(client):
    tool = {"type": "function", "function": {"name": "get-weather"}}
    with pytest.raises(openai.BadRequestError, match="not a Python identifier") as raised:
        chat(client, tools=[tool], tool_choice="required")
    assert raised.value.body["param"] == "tools"  # type: ignore[index]
