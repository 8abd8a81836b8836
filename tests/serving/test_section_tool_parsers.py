"""DeepSeek's and Kimi K2's tool calls (serving.tool_parsers): a section of calls between
markers, read the same whether fed whole or piece by piece; what is not a call of an offered tool
stays content; Kimi's call header is the call's id; the grammars write exactly calls of the
offered functions through the markers (special tokens by id, added tokens as text); DeepSeek's
templates get an earlier call's arguments as JSON text."""

from __future__ import annotations

import json
import string

import pytest
from tokenizers import AddedToken

from osd.decode.grammar import GrammarCompiler
from osd.toy_models import char_tokenizer
from serving.tool_parsers import ParsedCall, detect_parser, tool_call_format
from tests.serving.test_tool_parsers import FUNCTIONS, ONE_PLUS_TWO, OSLO, scan

CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_END, KIMI_ARGUMENTS = (
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
    "<|tool_call_argument_begin|>",
)


def v31(name: str, arguments: str) -> str:
    return f"{CALL}{name}{SEP}{arguments}{CALL_END}"


def v3(name: str, arguments: str) -> str:
    return f"{CALL}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def kimi(header: str, arguments: str) -> str:
    return f"{KIMI_CALL}{header}{KIMI_ARGUMENTS}{arguments}{KIMI_END}"


WEATHER, CALC = '{"city": "Oslo"}', '{"expression": "1 + 2"}'
KIMI_OSLO = ParsedCall("get_weather", WEATHER, "functions.get_weather:0")
KIMI_CALC = ParsedCall("calc", CALC, "functions.calc:1")

CASES = {
    "deepseek_v31": [
        ("plain text", ("plain text", [])),
        (f"{CALLS}{v31('get_weather', WEATHER)}{CALLS_END}", ("", [OSLO])),
        (
            f"Let me look.\n\n{CALLS}{v31('get_weather', WEATHER)}{v31('calc', CALC)}{CALLS_END}",
            ("Let me look.", [OSLO, ONE_PLUS_TWO]),
        ),
        # Text after the section is content; a call without the section's marker is a call.
        (f"{CALLS}{v31('calc', CALC)}{CALLS_END} Done.", (" Done.", [ONE_PLUS_TWO])),
        (f"x {v31('calc', CALC)}", ("x", [ONE_PLUS_TWO])),
        (f"{CALLS}{v31('calc', CALC)}{CALLS_END}\n", ("", [ONE_PLUS_TWO])),
        # Not calls: unknown function, broken JSON, no arguments, unfinished, empty section.
        (f"x {CALLS}{v31('rm', '{}')}{CALLS_END} y", None),
        (f"{CALLS}{v31('calc', '{')}{CALLS_END}", None),
        (f"{CALLS}{CALL}calc{CALL_END}{CALLS_END}", None),
        (f"{CALLS}{CALL}calc{SEP}{{", None),
        (f"a {CALLS} {CALLS_END} b", None),
        ("a <｜tool", None),
        # One bad call among good ones: the good one is a call, the bad one content.
        (
            f"{CALLS}{v31('rm', '{}')}{v31('calc', CALC)}{CALLS_END}",
            (f"{CALLS}{v31('rm', '{}')}", [ONE_PLUS_TWO]),
        ),
    ],
    "deepseek_v3": [
        ("plain text", ("plain text", [])),
        (
            f"{CALLS}{v3('get_weather', WEATHER)}\n{v3('calc', CALC)}{CALLS_END}",
            ("", [OSLO, ONE_PLUS_TWO]),
        ),
        (f"ok {CALLS}{v3('calc', CALC)}{CALLS_END}", ("ok", [ONE_PLUS_TWO])),
        # The fence's language and newlines are forgiven; its absence is not a V3 call.
        (f"{CALLS}{CALL}function{SEP}calc\n```json{CALC}```{CALL_END}", ("", [ONE_PLUS_TWO])),
        (f"{CALLS}{CALL}function{SEP}calc {CALC}{CALL_END}{CALLS_END}", None),
        (f"{CALLS}{v3('rm', '{}')}{CALLS_END}", None),
    ],
    "kimi_k2": [
        ("plain text", ("plain text", [])),
        (
            f"{SECTION}{kimi('functions.get_weather:0', WEATHER)}"
            f"{kimi('functions.calc:1', CALC)}{SECTION_END}",
            ("", [KIMI_OSLO, KIMI_CALC]),
        ),
        # Whitespace between the markers, as Kimi's documentation shows it.
        (
            f"Sure.\n{SECTION}\n{kimi('functions.get_weather:0', WEATHER)}\n{SECTION_END}",
            ("Sure.", [KIMI_OSLO]),
        ),
        # A header without the call's number: a call, its id made here.
        (f"{SECTION}{kimi('get_weather', WEATHER)}{SECTION_END}", ("", [OSLO])),
        (f"{SECTION}{kimi('functions.rm:0', '{}')}{SECTION_END}", None),
        (
            f"{SECTION}{kimi('functions.calc:0', CALC)}",
            ("", [ParsedCall("calc", CALC, "functions.calc:0")]),
        ),
        (f"{SECTION}{KIMI_CALL}functions.calc:0{KIMI_ARGUMENTS}{{", None),
    ],
}


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [(parser, text, expected) for parser, cases in CASES.items() for text, expected in cases],
)
@pytest.mark.parametrize("pieces", [0, 1, 3, 7])
def test_sections_read_alike_whole_and_in_pieces(parser, text, expected, pieces):
    assert scan(parser, text, pieces) == (expected or (text, []))


def test_content_streams_until_the_section_and_each_call_goes_out_when_it_ends():
    from serving.tool_parsers import ToolCallScanner

    scanner = ToolCallScanner("deepseek_v31", ["get_weather", "calc"])
    assert scanner.feed("Sure, ") == ("Sure,", [])
    assert scanner.feed("<｜tool") == ("", [])  # may open the section: held back
    assert scanner.feed("▁calls▁begin｜>" + v31("get_weather", WEATHER)) == ("", [OSLO])
    assert scanner.feed(CALL + "calc" + SEP + CALC) == ("", [])  # not ended yet
    assert scanner.feed(CALL_END + CALLS_END) == ("", [ONE_PLUS_TWO])
    assert scanner.finish() == ("", [])


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        # DeepSeek V3 / R1-0528: the arguments in a JSON fence.
        (
            "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' "
            "+ tool['function']['name'] + '\\n' + '```json' + '\\n' + args + '\\n' + '```' }}",
            "deepseek_v3",
        ),
        (
            "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] "
            "+ '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}",
            "deepseek_v31",
        ),
        ("{{ '<|tool_calls_section_begin|>' }}<|tool_call_begin|>{{ id }}", "kimi_k2"),
    ],
)
def test_the_section_formats_are_detected_from_the_chat_template(template, parser):
    assert detect_parser(template) == parser


def _marked(special: bool, *markers: str):
    # The toy's characters and the backtick (DeepSeek V3's fence).
    tokenizer = char_tokenizer(string.ascii_lowercase + string.digits + ' .,:;!?()[]{}"\n<>_`')
    tokenizer.add_tokens([AddedToken(m, special=special) for m in markers], special_tokens=special)
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer))


def _accepts(tokenizer, compiler, source: str, text: str) -> bool:
    matcher = compiler.compile("lark", source).matcher()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31", "kimi_k2"])
def test_grammars_write_calls_of_the_offered_functions_through_the_markers(parser):
    deepseek = parser.startswith("deepseek")
    markers = (
        (CALLS, CALLS_END, CALL, CALL_END, SEP)
        if deepseek
        else (SECTION, SECTION_END, KIMI_CALL, KIMI_END, KIMI_ARGUMENTS)
    )
    # DeepSeek's markers are added tokens, Kimi's special ones (as in their tokenizers).
    tokenizer, compiler = _marked(not deepseek, *markers)
    form = tool_call_format(parser, None, tokenizer)
    assert len(form.marker_ids) == 5 and form.special_text is not deepseek
    write = {"deepseek_v3": v3, "deepseek_v31": v31}.get(parser)
    opening, closing = markers[:2]

    def call(name: str, arguments: str, number: int) -> str:
        return (
            kimi(f"functions.{name}:{number}", arguments)
            if write is None
            else write(name, arguments)
        )

    one = call("get_weather", '{"city": "oslo", "unit": "c"}', 0)
    two = one + form.separator + call("calc", "{}", 1)
    parallel = form.grammar(FUNCTIONS, parallel=True)
    single = form.grammar(FUNCTIONS, parallel=False)
    assert _accepts(tokenizer, compiler, parallel, opening + one + closing)
    assert _accepts(tokenizer, compiler, parallel, opening + two + closing)
    assert _accepts(tokenizer, compiler, single, opening + one + closing)
    assert not _accepts(tokenizer, compiler, single, opening + two + closing)
    for bad in [
        call("get_weather", '{"unit": "c"}', 0),  # a required argument missing
        call("rm", "{}", 0),  # not offered
        call("get_weather", '{"city":"oslo"}', 0),  # compact: not how the template writes
    ]:
        assert not _accepts(tokenizer, compiler, parallel, opening + bad + closing), bad
    assert not _accepts(tokenizer, compiler, parallel, one)  # the section's markers are due
    # What the grammar makes, the scanner reads back as calls.
    content, calls = scan(parser, opening + two + closing)
    assert content == "" and [c.name for c in calls] == ["get_weather", "calc"]
    assert json.loads(calls[0].arguments) == {"city": "oslo", "unit": "c"}
    if write is None:  # Kimi: the header is the id
        assert [c.call_id for c in calls] == ["functions.get_weather:0", "functions.calc:1"]


def test_deepseek_templates_get_an_earlier_calls_arguments_as_json_text():
    history = [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "function": {"name": "calc", "arguments": {"x": [1, "é"]}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    mapped = tool_call_format("deepseek_v31").template_messages(json.loads(json.dumps(history)))
    assert mapped[0]["tool_calls"][0]["function"]["arguments"] == '{"x": [1, "é"]}'
    assert mapped[0]["tool_calls"][0]["id"] == "call_1" and mapped[1] == history[1]
    # Kimi's template writes them with tojson: left as objects.
    kept = tool_call_format("kimi_k2").template_messages(json.loads(json.dumps(history)))
    assert kept == history


def test_kimi_calls_keep_the_models_ids_unless_it_wrote_one_twice():
    from serving.chat_replies import ChatReply
    from serving.tools import ToolPlan

    tools = [{"type": "function", "function": {"name": name}} for name in ("get_weather", "calc")]
    reply = ChatReply(None, tool_call_format("kimi_k2"), ToolPlan(tools, (), parallel=True))
    text = (
        f"{SECTION}{kimi('functions.calc:0', CALC)}{kimi('functions.calc:0', CALC)}"
        f"{kimi('calc', CALC)}{SECTION_END}"
    )
    message, reason = reply.message(text, "stop")
    ids = [call["id"] for call in message["tool_calls"]]
    assert reason == "tool_calls" and ids[0] == "functions.calc:0"
    assert len(set(ids)) == 3 and all(i.startswith("call_") for i in ids[1:])
