"""Tool-call parsers (serving.tool_parsers): replies read as OpenAI tool calls, the same whether
fed whole or piece by piece; what is not a call of an offered tool stays content; the grammars
accept exactly the calls of the offered functions."""

from __future__ import annotations

import json

import pytest

from osd.decode.grammar import GrammarCompiler
from osd.toy_models import char_tokenizer
from serving.tool_parsers import (
    ParsedCall,
    ToolCallScanner,
    detect_parser,
    tool_call_format,
)

NAMES = ["get_weather", "calc"]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALC = '<tool_call>\n{"name":"calc","arguments":{"expression":"1 + 2"}}\n</tool_call>'
OSLO = ParsedCall("get_weather", '{"city": "Oslo"}')
ONE_PLUS_TWO = ParsedCall("calc", '{"expression": "1 + 2"}')


def scan(parser: str, text: str, pieces: int = 0, parallel: bool = True, schemas=None):
    """(content, calls) of ``text`` fed whole (pieces 0) or in pieces of that many chars;
    the functions offered: ``schemas``' (names and parameters), or ``NAMES``."""
    scanner = ToolCallScanner(parser, list(schemas or NAMES), parallel, schemas)
    content, calls = "", []
    step = pieces or len(text) or 1
    for at in range(0, len(text), step):
        more, done = scanner.feed(text[at : at + step])
        content, calls = content + more, calls + done
    more, done = scanner.finish()
    return content + more, calls + done


HERMES_CASES = [
    ("plain text", ("plain text", [])),
    ("", ("", [])),
    (WEATHER, ("", [OSLO])),
    (f"Let me look.\n{WEATHER}", ("Let me look.", [OSLO])),
    (f"{WEATHER}\n{CALC}", ("", [OSLO, ONE_PLUS_TWO])),
    (f"  {WEATHER}\n", ("", [OSLO])),
    # Not calls: unknown function, broken JSON, arguments not an object, unfinished.
    ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', None),
    ('<tool_call>\n{"name": "calc", "arguments": {\n</tool_call>', None),
    ('<tool_call>\n{"name": "calc", "arguments": [1]}\n</tool_call>', None),
    ('<tool_call>\n{"name": "calc", "argu', None),
    ("a < b and <tool is not a call", None),
    ('<tool_call>{"name": "calc", "arguments": {"x": NaN}}</tool_call>', None),  # not JSON
    # Text before a call that is not one keeps its whitespace.
    ('x  <tool_call>\n{"name": "calc"', None),
    ('x \n<tool_call>{"name": "rm", "arguments": {}}</tool_call>', None),
    # Numbers as the model wrote them: a float would make 3e999 Infinity (not JSON) and
    # round 0.2959151845551666368.
    (
        '<tool_call>{"name": "calc", "arguments": {"x": 3e999, "y": 0.2959151845551666368, '
        '"z": [1, 2.50]}}</tool_call>',
        ("", [ParsedCall("calc", '{"x": 3e999, "y": 0.2959151845551666368, "z": [1, 2.50]}')]),
    ),
    # Arguments written as JSON text are read as the object they hold.
    (
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2\\"}"}</tool_call>',
        ("", [ParsedCall("calc", '{"expression": "2"}')]),
    ),
]


@pytest.mark.parametrize(("text", "expected"), HERMES_CASES)
@pytest.mark.parametrize("pieces", [0, 1, 3, 7])
def test_hermes_replies_read_alike_whole_and_in_pieces(text, expected, pieces):
    assert scan("hermes", text, pieces) == (expected or (text, []))


LLAMA_CASES = [
    ("The weather is fine.", None),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', ("", [OSLO])),
    (
        '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}; '
        '{"name": "calc", "parameters": {"expression": "1 + 2"}}',
        ("", [OSLO, ONE_PLUS_TWO]),
    ),
    ('{"name": "nope", "parameters": {}}', None),
    ('{"name": "calc", "parameters": {"expression"', None),
    ('{"a": 1} is JSON', None),
]


@pytest.mark.parametrize(("text", "expected"), LLAMA_CASES)
@pytest.mark.parametrize("pieces", [0, 1, 5])
def test_llama3_json_replies_read_alike_whole_and_in_pieces(text, expected, pieces):
    assert scan("llama3_json", text, pieces) == (expected or (text, []))


MISTRAL_CALLS = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "calc", ' + (
    '"arguments": {"expression": "1 + 2"}}]'
)
MISTRAL_CASES = [
    ("plain text", ("plain text", [])),
    ("a [1, 2] list, [ok]", ("a [1, 2] list, [ok]", [])),
    # Before v11: one marker, a JSON list of calls (or one call's object).
    (f"[TOOL_CALLS] {MISTRAL_CALLS}", ("", [OSLO, ONE_PLUS_TWO])),
    (f"Let me look. [TOOL_CALLS] {MISTRAL_CALLS}", ("Let me look.", [OSLO, ONE_PLUS_TWO])),
    ('[TOOL_CALLS] {"name": "get_weather", "arguments": {"city": "Oslo"}}', ("", [OSLO])),
    # v11: a marker, the name, an optional call id and [ARGS] before each call's arguments.
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
        '[TOOL_CALLS]calc[ARGS]{"expression": "1 + 2"}',
        ("", [OSLO, ONE_PLUS_TWO]),
    ),
    ('ok [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}', ("ok", [OSLO])),
    ('[TOOL_CALLS]get_weather{"city": "Oslo"}', ("", [OSLO])),
    # Not calls: an unknown function, broken JSON, one bad call among good ones, no call.
    # Text after the calls is content (the calls kept), as vLLM's parser leaves it.
    (f"[TOOL_CALLS] {MISTRAL_CALLS} Done.", ("Done.", [OSLO, ONE_PLUS_TWO])),
    ('[TOOL_CALLS]calc[ARGS]{"expression": "1 + 2"} ok', ("ok", [ONE_PLUS_TWO])),
    ("[TOOL_CALLS]rm[ARGS]{}", None),
    ('[TOOL_CALLS] [{"name": "calc", "arguments": {"expression"', None),
    ("[TOOL_CALLS]calc[ARGS]{}[TOOL_CALLS]rm[ARGS]{}", None),
    ("[TOOL_CALLS]", None),
    ("x [TOOL_CALL", None),
]


@pytest.mark.parametrize(("text", "expected"), MISTRAL_CASES)
@pytest.mark.parametrize("pieces", [0, 1, 5])
def test_mistral_replies_read_alike_whole_and_in_pieces(text, expected, pieces):
    assert scan("mistral", text, pieces) == (expected or (text, []))


def test_content_streams_before_a_call_and_held_back_text_only_as_long_as_needed():
    scanner = ToolCallScanner("hermes", NAMES)
    assert scanner.feed("Sure") == ("Sure", [])
    assert scanner.feed(", <tool") == (",", [])  # " <tool" may open a call
    assert scanner.feed("bar> x") == (" <toolbar> x", [])
    assert scanner.feed("\n") == ("", [])  # trailing whitespace waits for what follows
    assert scanner.feed(WEATHER) == ("", [OSLO])
    assert scanner.feed("\nDone.") == ("\nDone.", [])
    assert scanner.finish() == ("", [])


def test_parallel_false_keeps_the_first_call():
    assert scan("hermes", f"{WEATHER}\n{CALC}", parallel=False) == ("", [OSLO])


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{% for m in messages %}<tool_call>{% endfor %}", "hermes"),
        ("{{- '<|python_tag|>' }}", "llama3_json"),
        ("{{- '[TOOL_CALLS] [' }}", "mistral"),
        # Qwen3-Coder's XML calls inside <tool_call>.
        ("{{- '<tool_call>\n<function=' + name + '>' }}", "qwen3_coder"),
        # gpt-oss's harmony messages (read by serving.harmony).
        (
            "{{- '<|start|>assistant to=' }}{{- '<|channel|>c<|message|>' }}{{- '<|call|>' }}",
            "openai",
        ),
        ("{{ messages }}", None),
        (None, None),
    ],
)
def test_the_parser_is_detected_from_the_chat_template(template, parser):
    assert detect_parser(template) == parser


FUNCTIONS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
    {"name": "calc"},  # no parameters: any object
]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(char_tokenizer(), 64)


def _accepts(compiler, source: str, text: str) -> bool:
    matcher = compiler.compile("lark", source).matcher()
    ids = char_tokenizer()(text, add_special_tokens=False)["input_ids"]
    return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_grammars_accept_exactly_calls_of_the_offered_functions(compiler, parser):
    form = tool_call_format(parser)
    key = form.arguments_key

    def call(name: str, arguments: str) -> str:
        return f'{form.start}{{"name":"{name}","{key}":{arguments}}}{form.end}'

    one = call("get_weather", '{"city":"oslo","unit":"c"}')
    two = one + form.separator + call("calc", "{}")
    parallel = form.grammar(FUNCTIONS, parallel=True)
    single = form.grammar(FUNCTIONS, parallel=False)
    assert _accepts(compiler, parallel, one) and _accepts(compiler, parallel, two)
    assert _accepts(compiler, single, one) and not _accepts(compiler, single, two)
    for bad in [
        call("get_weather", '{"unit":"c"}'),  # a required argument missing
        call("get_weather", '{"city":"oslo","unit":"k"}'),  # outside the enum
        call("rm", "{}"),  # not offered
        f'{form.start}{{"{key}":{{}},"name":"calc"}}{form.end}',  # name first
        "hello",
    ]:
        assert not _accepts(compiler, parallel, bad), bad
    # What the grammar makes, the scanner reads back as calls.
    content, calls = scan(parser, two)
    assert content == "" and [c.name for c in calls] == ["get_weather", "calc"]
    assert json.loads(calls[0].arguments) == {"city": "oslo", "unit": "c"}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_parameters_with_definitions_and_references_compile_and_bind(compiler, parser):
    # openai.pydantic_function_tool writes nested models as $defs and $ref: under the call's
    # arguments key those pointers would not resolve, so the definitions move to its root.
    form = tool_call_format(parser)
    key = form.arguments_key
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    parameters = {
        "$defs": {"Place": place},
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/Place"}, "again": {"$ref": "#/properties/at"}},
        "required": ["at"],
        "additionalProperties": False,
    }
    source = form.grammar([{"name": "go", "parameters": parameters}], parallel=False)

    def call(arguments: str) -> str:
        return f'{form.start}{{"name":"go","{key}":{arguments}}}{form.end}'

    assert _accepts(compiler, source, call('{"at":{"city":"oslo"},"again":{"city":"x"}}'))
    assert not _accepts(compiler, source, call('{"at":{"town":"oslo"}}'))
    assert not _accepts(compiler, source, call('{"at":{"city":"oslo"},"again":{}}'))


def test_references_resolve_where_the_parameters_say_and_data_is_left_alone(compiler):
    form = tool_call_format("hermes")
    # Parameters with an $id are a resource of their own: their references resolve in them.
    own = {
        "$id": "https://example.com/p",
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/A"}},
        "$defs": {"A": {"type": "string"}},
    }
    source = form.grammar([{"name": "f", "parameters": own}], parallel=False)
    assert _accepts(
        compiler, source, '<tool_call>\n{"name":"f","arguments":{"a":"x"}}\n</tool_call>'
    )
    # A "$ref" inside const is a value to write, not a reference to follow.
    data = {"type": "object", "properties": {"a": {"const": {"$ref": "#/x"}}}}
    schema = form._call_schema({"name": "g", "parameters": data})
    assert schema["properties"]["arguments"]["properties"]["a"] == {"const": {"$ref": "#/x"}}


def test_a_call_whose_arguments_hold_a_lone_surrogate_stays_text():
    # JSON's "\ud800" parses to a character UTF-8 cannot carry: the answer could not be sent.
    text = '<tool_call>{"name": "calc", "arguments": {"x": "\\ud800"}}</tool_call>'
    assert scan("hermes", text) == (text, [])


def test_a_function_without_parameters_takes_no_arguments(compiler):
    form = tool_call_format("hermes")
    source = form.grammar([{"name": "now"}], parallel=False)
    assert _accepts(compiler, source, '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>')
    assert not _accepts(
        compiler, source, '<tool_call>\n{"name":"now","arguments":{"a":1}}\n</tool_call>'
    )


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        tool_call_format("granite")


@pytest.fixture(scope="module")
def marked():
    """The toy tokenizer with Mistral's markers as special tokens (ids 64, 65), as Mistral's."""
    from tokenizers import AddedToken

    tokenizer = char_tokenizer()
    tokenizer.add_tokens(
        [AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)],
        special_tokens=True,
    )
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer))


@pytest.mark.parametrize(
    ("template", "opening"),
    [
        ("{{ '[TOOL_CALLS] [' }}", "[TOOL_CALLS] ["),  # Mistral 7B v0.3
        ("{{ '[TOOL_CALLS][' }}", "[TOOL_CALLS]["),  # Tekken: Nemo, Small 3 and 3.1
        ("[TOOL_CALLS]{{ name }}[ARGS]", None),  # v11
    ],
)
def test_mistral_grammars_name_the_special_markers_and_read_back_as_calls(
    marked, template, opening
):
    tokenizer, compiler = marked
    form = tool_call_format("mistral", template, tokenizer)
    assert dict(form.marker_ids) == (
        {"[TOOL_CALLS]": 64}
        if form.arguments_marker is None
        else {"[TOOL_CALLS]": 64, "[ARGS]": 65}
    )
    # JSON spaced as the templates' tojson writes it.
    if opening:  # before v11
        one = opening + '{"name": "get_weather", "arguments": {"city": "oslo", "unit": "c"}}]'
        two = one[:-1] + ', {"name": "calc", "arguments": {}}]'
    else:
        one = '[TOOL_CALLS]get_weather[ARGS]{"city": "oslo", "unit": "c"}'
        two = one + "[TOOL_CALLS]calc[ARGS]{}"

    def accepts(source: str, text: str) -> bool:
        matcher = compiler.compile("lark", source).matcher()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())

    parallel = form.grammar(FUNCTIONS, parallel=True)
    single = form.grammar(FUNCTIONS, parallel=False)
    assert accepts(parallel, one) and accepts(parallel, two)
    assert accepts(single, one) and not accepts(single, two)
    # The marker is the special token: text cannot begin to spell it.
    matcher = compiler.compile("lark", parallel).matcher()
    assert not matcher.consume_token(tokenizer.convert_tokens_to_ids("["))
    assert not accepts(parallel, one.replace("get_weather", "rm"))
    assert not accepts(parallel, one.replace(": ", ":"))  # compact: not what the model saw
    if opening:  # the other opening is not this template's
        other = "[TOOL_CALLS][" if opening == "[TOOL_CALLS] [" else "[TOOL_CALLS] ["
        assert not accepts(parallel, one.replace(opening, other))
    content, calls = scan("mistral", two)
    assert content == "" and [c.name for c in calls] == ["get_weather", "calc"]


def test_mistral_ids_are_nine_letters_and_digits_and_the_history_is_mapped_alike():
    form = tool_call_format("mistral")
    ids = {form.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
    history = [
        {"role": "assistant", "tool_calls": [{"id": "call_abc-1"}, {"id": "Ab3dE6gH9"}]},
        {"role": "tool", "tool_call_id": "call_abc-1"},
        {"role": "tool", "tool_call_id": "Ab3dE6gH9"},
    ]
    mapped = form.template_messages(history)
    first, kept = (call["id"] for call in mapped[0]["tool_calls"])
    assert len(first) == 9 and first.isalnum() and kept == "Ab3dE6gH9"
    assert [m["tool_call_id"] for m in mapped[1:]] == [first, kept]
    assert tool_call_format("hermes").new_call_id().startswith("call_")


@pytest.mark.parametrize(
    ("writes", "spaced"),
    [
        ("{{ call.function | tojson }}", True),  # Qwen's, Llama's, Mistral's
        ("{{ call.function | tojson(separators=(',', ':')) }}", False),  # the demo pair's
        ("{{ call.function.name }}", None),  # shows no arguments: the format's own default
    ],
)
def test_forced_calls_are_spaced_as_the_template_writes_earlier_calls(compiler, writes, spaced):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for call in m.tool_calls or [] %}<tool_call>" + writes + "</tool_call>{% endfor %}"
        "{% endfor %}"
    )
    form = tool_call_format("hermes", tokenizer.chat_template, tokenizer)
    assert form.spaced is (False if spaced is None else spaced)  # hermes: compact by default
    source = form.grammar(FUNCTIONS, parallel=False)
    compact = '{"name":"get_weather","arguments":{"city":"oslo","unit":"c"}}'
    written = compact.replace('":', '": ').replace(',"', ', "') if form.spaced else compact
    assert _accepts(compiler, source, f"<tool_call>\n{written}\n</tool_call>")
    other = compact if form.spaced else compact.replace('":', '": ')
    assert not _accepts(compiler, source, f"<tool_call>\n{other}\n</tool_call>")


def test_hermes_markers_that_are_added_tokens_are_named_by_id():
    # Qwen 2.5 / 3 add <tool_call> and </tool_call> as tokens that are not special: llguidance
    # lets no grammar text spell them, so a forced call names them by id, and the reply keeps
    # no other special tokens for them.
    from tokenizers import AddedToken

    tokenizer = char_tokenizer()
    tokenizer.add_tokens([AddedToken(m, special=False) for m in ("<tool_call>", "</tool_call>")])
    form = tool_call_format("hermes", None, tokenizer)
    assert dict(form.marker_ids) == {"<tool_call>": 64, "</tool_call>": 65}
    assert not form.special_text
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    source = form.grammar(FUNCTIONS, parallel=False)
    text = '<tool_call>\n{"name":"calc","arguments":{}}\n</tool_call>'
    matcher = compiler.compile("lark", source).matcher()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 64 and matcher.consume_tokens(ids) and matcher.is_accepting()
