"""GLM-4.5 to 4.7's tool calls (serving.tool_parsers, ``glm45`` / ``glm47``):
``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>``, with GLM-4.5's
newlines or GLM-4.7's none, read the same whole and in pieces, each value typed by its schema
(strings as written); the grammar's layout read from the chat template, its markers by id where
the tokenizer adds them; and through /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tokenizers import AddedToken

from osd.decode.grammar import GrammarCompiler
from osd.toy_models import char_tokenizer
from serving.tool_parsers import ParsedCall, detect_parser, tool_call_format
from tests.reliability.conftest import Replica
from tests.serving.test_tool_parsers import scan
from tests.serving.test_tools_api import (
    ASK,
    TOOLS,
    chat,
    named_call_streams_as_whole,
    required_calls_follow_schema,
    template_replica,
)


def template(newline: str) -> str:
    """GLM's way of writing earlier calls, in the toy's alphabet (``newline``: GLM-4.5's "\\n",
    GLM-4.7's "")."""
    return (
        "{%- if tools -%}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n"
        "{% endif -%}{%- for m in messages -%}"
        "{%- if m.role == 'tool' -%}result: {{ m.content }}\n"
        "{%- else -%}{{ m.role }}: {{ m.content or '' }}"
        "{%- for tc in m.tool_calls or [] %}"
        f"<tool_call>{{{{ tc.function.name }}}}{newline}"
        "{% for k, v in tc.function.arguments.items() %}"
        f"<arg_key>{{{{ k }}}}</arg_key>{newline}"
        f"<arg_value>{{{{ v | tojson if v is not string else v }}}}</arg_value>{newline}"
        "{% endfor %}</tool_call>{% endfor %}\n{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt %}assistant: {% endif -%}"
    )


SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "tags": {"type": "array"},
            "metric": {"type": "boolean"},
        },
    },
    "calc": {},
}
NEW_YORK = ParsedCall("get_weather", '{"city": "New York, NY", "days": 3}')


def glm45(name: str, **arguments: str) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in arguments.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def glm47(name: str, **arguments: str) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in arguments.items()
    )
    return f"<tool_call>{name}{pairs}</tool_call>"


CASES = [
    ("plain text", ("plain text", [])),
    (glm45("get_weather", city="New York, NY", days="3"), ("", [NEW_YORK])),
    (glm47("get_weather", city="New York, NY", days="3"), ("", [NEW_YORK])),
    (
        f"Let me check.\n{glm45('get_weather', city='New York, NY', days='3')}\n{glm45('calc')}",
        ("Let me check.", [NEW_YORK, ParsedCall("calc", "{}")]),
    ),
    # Values as the schema types them; a string as it is written, spaces and all.
    (
        glm47("get_weather", city=" 3 ", tags='["a", 2]', metric="true", days="x"),
        (
            "",
            [
                ParsedCall(
                    "get_weather", '{"city": " 3 ", "tags": ["a", 2], "metric": true, "days": "x"}'
                )
            ],
        ),
    ),
    # Not calls: an unknown function, text among the pairs, a key without its value, unfinished.
    (glm45("rm", path="/"), None),
    ("<tool_call>calc\n<arg_key>n</arg_key>\nstray</tool_call>", None),
    ("<tool_call>calc<arg_key>n</arg_key></tool_call>", None),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>os", None),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
@pytest.mark.parametrize("pieces", [0, 1, 3, 7])
@pytest.mark.parametrize("parser", ["glm45", "glm47"])
def test_glm_replies_read_alike_whole_and_in_pieces(parser, text, expected, pieces):
    assert scan(parser, text, pieces, schemas=SCHEMAS) == (expected or (text, []))


def test_glm_is_detected_and_its_layout_read_from_the_template():
    assert detect_parser(template("\n")) == "glm45"
    spaced, compact = char_tokenizer(), char_tokenizer()
    spaced.chat_template, compact.chat_template = template("\n"), template("")
    four_five = tool_call_format("glm45", spaced.chat_template, spaced).xml
    four_seven = tool_call_format("glm45", compact.chat_template, compact).xml
    assert four_five is not None and four_seven is not None
    assert (four_five.opening, four_five.item_end) == ("{name}\n", "\n")
    assert (four_seven.opening, four_seven.item_end) == ("{name}", "")
    assert four_seven.key == "<arg_key>{key}</arg_key><arg_value>"
    # A template that shows no GLM call: the layout of the parser's name.
    for name, shown in [("glm45", four_five), ("glm47", four_seven)]:
        assert tool_call_format(name, None, char_tokenizer()).xml == tool_call_format(name).xml
        assert tool_call_format(name).xml == shown


FUNCTIONS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1},
                "metric": {"type": "boolean"},
            },
            "required": ["city"],
        },
    },
    {"name": "calc"},
]


@pytest.mark.parametrize("added", [False, True], ids=["text", "added tokens"])
@pytest.mark.parametrize("newline", ["\n", ""])
def test_grammars_write_the_templates_layout_and_read_back(added, newline):
    tokenizer = char_tokenizer()
    if added:  # GLM's tokenizers add its markers as tokens
        markers = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>"]
        tokenizer.add_tokens([AddedToken(m, special=False) for m in [*markers, "</arg_value>"]])
    tokenizer.chat_template = template(newline)
    form = tool_call_format("glm45", tokenizer.chat_template, tokenizer)
    assert len(form.marker_ids) == (6 if added else 0)
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    write = glm45 if newline else glm47
    one = write("get_weather", city="oslo, n", days="2")
    two = one + "\n" + write("calc")
    parallel = form.grammar(FUNCTIONS, parallel=True)

    def accepts(text: str) -> bool:
        matcher = compiler.compile("lark", parallel).matcher()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())

    assert accepts(one) and accepts(two) and accepts(write("get_weather", city="", metric="true"))
    for bad in [
        write("get_weather", days="2"),  # city is required
        write("get_weather", city="toolongcity"),  # over maxLength
        write("get_weather", city="x", days="0"),  # under the minimum
        write("get_weather", days="2", city="x"),  # not the schema's order
        (glm47 if newline else glm45)("get_weather", city="x"),  # the other layout
        write("rm"),
    ]:
        assert not accepts(bad), bad
    assert scan("glm45", two, schemas=SCHEMAS)[1] == [
        ParsedCall("get_weather", '{"city": "oslo, n", "days": 2}'),
        ParsedCall("calc", "{}"),
    ]


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with template_replica(template(chr(10)), "glm45") as replica:
        yield replica


def test_required_calls_offered_tools_with_valid_arguments(client):
    required_calls_follow_schema(client)


@pytest.mark.parametrize("method", ["token", "block"])
def test_a_named_function_streamed_equals_the_whole_answer(client, method):
    named_call_streams_as_whole(client, "calc", method)


def test_a_history_of_calls_renders(client, replica):
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"n": 4}'}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ]
    tokens = replica.client.post("/tokenize", json={"messages": history}).json()["tokens"]
    prompt = replica.client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert glm45("calc", n="4") in prompt
    answer = chat(client, messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
