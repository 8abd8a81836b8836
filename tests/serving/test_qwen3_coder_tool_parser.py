"""Qwen3-Coder's XML tool calls (serving.tool_parsers, ``qwen3_coder``): replies read alike whole
and piece by piece, each value typed by its parameter's schema as vLLM's ``qwen3_coder`` parser
reads it; the forced-call grammar accepts what the chat template writes for a call and nothing
outside the tools' schemas, and what it makes reads back as the same calls."""

from __future__ import annotations

import json

import pytest

from osd.decode.grammar import GrammarCompiler
from osd.toy_models import char_tokenizer
from serving.tool_parsers import ParsedCall, ToolCallScanner, tool_call_format
from tests.serving.test_tool_parsers import scan as scan_as

# Qwen3-Coder's way of writing an earlier call, in the toy tokenizer's alphabet.
TEMPLATE = (
    "{%- if tools -%}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n"
    "{% endif -%}"
    "{%- for m in messages -%}{{ m.role }}: {{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] -%}"
    "{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
    "{%- for key, value in call.function.arguments | items -%}"
    "{{- '<parameter=' + key + '>\\n' }}"
    "{{- value if value is string else value | tojson }}"
    "{{- '\\n</parameter>\\n' }}"
    "{%- endfor -%}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}\n{% endfor -%}"
    "{%- if add_generation_prompt %}assistant: {% endif -%}"
)
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["c", "f", "1"]},
            "days": {"type": "integer"},
        },
        "required": ["city"],
    },
    "plot": {
        "type": "object",
        "properties": {
            "scale": {"type": "number"},
            "log": {"type": "boolean"},
            "options": {"type": "object"},
            "points": {"type": "array", "items": {"type": "integer"}},
            "title": {"type": ["string", "null"]},
        },
    },
}
FUNCTIONS = [{"name": name, "parameters": schema} for name, schema in SCHEMAS.items()]


def call_text(name: str, **arguments: str) -> str:
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def scan(text: str, pieces: int = 0, parallel: bool = True):
    return scan_as("qwen3_coder", text, pieces, parallel, SCHEMAS)


OSLO = call_text("get_weather", city="Oslo", days="3")
OSLO_CALL = ParsedCall("get_weather", '{"city": "Oslo", "days": 3}')
CASES = [
    ("plain text", ("plain text", [])),
    (OSLO, ("", [OSLO_CALL])),
    (f"let me look.\n{OSLO}", ("let me look.", [OSLO_CALL])),
    (f"{OSLO}\n{OSLO}", ("", [OSLO_CALL, OSLO_CALL])),
    # A string keeps its lines and markup; one newline each side is the format's.
    (
        call_text("get_weather", city="two\nlines <b>x</b>"),
        ("", [ParsedCall("get_weather", '{"city": "two\\nlines <b>x</b>"}')]),
    ),
    # Values typed by their schema, numbers as written; what does not parse stays text.
    (
        call_text(
            "plot",
            scale="2.50",
            log="True",
            options="{'grid': (1, 2)}",
            points="[1, 2]",
            title="null",
        ),
        (
            "",
            [
                ParsedCall(
                    "plot",
                    '{"scale": 2.50, "log": true, "options": {"grid": [1, 2]}, '
                    '"points": [1, 2], "title": null}',
                )
            ],
        ),
    ),
    (
        call_text("get_weather", city="null", days="three", unit="c"),
        ("", [ParsedCall("get_weather", '{"city": "null", "days": "three", "unit": "c"}')]),
    ),
    # A string enum without a type: its words are text, as the grammar writes them.
    (
        call_text("get_weather", city="x", unit="1"),
        ("", [ParsedCall("get_weather", '{"city": "x", "unit": "1"}')]),
    ),
    # A parameter left open before the next, and </function> missing: forgiven (as vLLM).
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n3\n"
        "</tool_call>",
        ("", [OSLO_CALL]),
    ),
    # Not a call of an offered function, or other text in it: content.
    (call_text("rm", path="/"), (call_text("rm", path="/"), [])),
    (
        "<tool_call>\n<function=get_weather>\nhi\n</function>\n</tool_call>",
        ("<tool_call>\n<function=get_weather>\nhi\n</function>\n</tool_call>", []),
    ),
    # A call whose function closed but whose <tool_call> did not (the reply ended): a call.
    (OSLO.removesuffix("\n</tool_call>"), ("", [OSLO_CALL])),
    # An unfinished call, cut by max_tokens: its text.
    (
        "<tool_call>\n<function=get_weather>\n<par",
        ("<tool_call>\n<function=get_weather>\n<par", []),
    ),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
@pytest.mark.parametrize("pieces", [0, 1, 4])
def test_replies_read_alike_whole_and_in_pieces(text, expected, pieces):
    assert scan(text, pieces) == expected


def test_parallel_false_keeps_the_first_call():
    assert scan(f"{OSLO}\n{call_text('plot')}", parallel=False) == ("", [OSLO_CALL])


def test_without_schemas_every_value_is_text():
    scanner = ToolCallScanner("qwen3_coder", ["get_weather"])
    _, calls = scanner.feed(OSLO)
    assert calls == [ParsedCall("get_weather", '{"city": "Oslo", "days": "3"}')]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _accepts(compiler, source: str, text: str) -> bool:
    matcher = compiler.compile("lark", source).matcher()
    ids = char_tokenizer()(text, add_special_tokens=False)["input_ids"]
    return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())


def _written(tokenizer, *calls: dict) -> str:
    """The calls as the chat template writes them in an assistant's turn."""
    history = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "a", "type": "function", "function": c} for c in calls],
        },
    ]
    text = tokenizer.apply_chat_template(history, tokenize=False)
    return text.split("assistant: ", 1)[1].strip()


def test_the_grammar_accepts_what_the_template_writes_and_nothing_outside_the_schemas(tokenizer):
    compiler = GrammarCompiler(tokenizer, 64)
    form = tool_call_format("qwen3_coder", TEMPLATE, tokenizer)
    assert form.spaced  # objects and arrays as tojson writes them
    parallel = form.grammar(FUNCTIONS, parallel=True)
    single = form.grammar(FUNCTIONS, parallel=False)
    weather = {"name": "get_weather", "arguments": {"city": "a\n<b>\n</c>", "unit": "c", "days": 3}}
    plot = {
        "name": "plot",
        "arguments": {"scale": 0.5, "options": {"a": [1, 2]}, "points": [], "title": "t"},
    }
    one, two = _written(tokenizer, weather), _written(tokenizer, weather, plot)
    assert _accepts(compiler, parallel, one) and _accepts(compiler, parallel, two)
    assert _accepts(compiler, single, one) and not _accepts(compiler, single, two)
    assert _accepts(compiler, parallel, call_text("plot"))  # nothing required
    # Booleans as JSON writes them, or as Qwen3-Coder's template does (Python's True: the toy
    # alphabet has no capitals).
    assert _accepts(compiler, parallel, call_text("plot", log="false"))
    assert '"True" | "False"' in parallel
    for bad in [
        call_text("get_weather", unit="c"),  # the required city missing
        call_text("get_weather", city="x", unit="k"),  # outside the enum
        call_text("get_weather", city="x", days="3.5"),  # not an integer
        call_text("plot", log="yes"),  # not a boolean
        call_text("get_weather", days="3", city="x"),  # not the schema's order
        call_text("get_weather", city="x\n</parameter>\nmore"),  # text after the value's end
        call_text("rm", path="x"),  # not offered
        "hello",
    ]:
        assert not _accepts(compiler, parallel, bad), bad
    # What the grammar makes, the scanner reads back as the calls.
    content, calls = scan(two)
    assert content == "" and [c.name for c in calls] == ["get_weather", "plot"]
    assert [json.loads(c.arguments) for c in calls] == [weather["arguments"], plot["arguments"]]


def test_a_string_with_max_length_is_bounded(tokenizer):
    compiler = GrammarCompiler(tokenizer, 64)
    bounded = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 3}}}
    source = tool_call_format("qwen3_coder").grammar([{"name": "f", "parameters": bounded}], False)
    for value, accepted in [("", True), ("a\nb", True), ("abcd", False)]:
        assert _accepts(compiler, source, call_text("f", q=value)) is accepted, value


def test_a_call_whose_function_closed_is_content_where_max_tokens_cut_the_reply():
    """The forgiven missing ``</tool_call>`` is the model's end of turn; a reply cut by its
    token limit there keeps its text, as every format's unfinished call does."""
    text = OSLO.removesuffix("\n</tool_call>")
    scanner = ToolCallScanner("qwen3_coder", ["get_weather"])
    content, calls = scanner.feed(text)
    more, last = scanner.finish(cut=True)
    assert (content + more, calls + last) == (text, [])
