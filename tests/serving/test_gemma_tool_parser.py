"""Gemma 4's tool calls (serving.tool_parsers, serving.call_values): ``<|tool_call>call:name{...}
<tool_call|>`` in Gemma's own notation of arguments, read the same whole and piece by piece;
what is not a call of an offered tool stays content; the grammar writes exactly calls of the
offered functions in that notation (keys sorted as Gemma's template writes them, strings
between its quote token), and what it writes reads back as the arguments."""

from __future__ import annotations

import json
import string

import pytest
from tokenizers import AddedToken

from osd.decode.grammar import GrammarCompiler
from osd.toy_models import char_tokenizer
from serving.call_values import gemma_arguments
from serving.chat_replies import ChatReply, Piece
from serving.tool_parsers import ParsedCall, detect_parser, tool_call_format
from serving.tools import ToolPlan
from tests.serving.test_section_tool_parsers import _accepts, _marked
from tests.serving.test_tool_parsers import FUNCTIONS, scan

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
MARKERS = (OPEN, CLOSE, QUOTE)


def call(name: str, arguments: str) -> str:
    return f"{OPEN}call:{name}{{{arguments}}}{CLOSE}"


def quoted(text: str) -> str:
    return f"{QUOTE}{text}{QUOTE}"


OSLO = ParsedCall("get_weather", '{"city": "Oslo, NO"}')
OSLO_CALL = call("get_weather", f"city:{quoted('Oslo, NO')}")
CALC = ParsedCall("calc", '{"n": 3, "exact": true}')

CASES = [
    ("plain text", ("plain text", [])),
    (OSLO_CALL, ("", [OSLO])),
    (
        f"Let me look.\n{OSLO_CALL}" + call("calc", "n:3,exact:true"),
        ("Let me look.", [OSLO, CALC]),
    ),
    # Bare words, numbers as written, nesting, JSON's quotes.
    (
        call("calc", f'a:1.50,b:null,c:[1,{quoted("x")}],d:{{e:celsius}},{quoted("f g")}:"h"'),
        (
            "",
            [
                ParsedCall(
                    "calc",
                    '{"a": 1.50, "b": null, "c": [1, "x"], "d": {"e": "celsius"}, "f g": "h"}',
                )
            ],
        ),
    ),
    (call("calc", ""), ("", [ParsedCall("calc", "{}")])),
    # Whole calls as some checkpoints write them, read as vLLM reads them: the reply ended
    # (at the end-of-turn token) where ``<tool_call|>`` was due; ``call`` left out.
    (f"Sure.\n{OPEN}call:calc{{n:3}}", ("Sure.", [ParsedCall("calc", '{"n": 3}')])),
    (f"{OPEN}:calc{{n:3}}{CLOSE}", ("", [ParsedCall("calc", '{"n": 3}')])),
    # Not calls: an unknown function, an unterminated string, a key without a value, no
    # braces, a call the reply cut short; their text stays content.
    (f"x {call('rm', 'a:1')} y", None),
    (call("calc", f"a:{QUOTE}open"), None),
    (call("calc", "a:1,b"), None),
    (f"{OPEN}calc(n=3){CLOSE}", None),
    (f"{OPEN}call:calc{{n:3,m:{{k:1}}", None),
    (f"{OPEN}call:calc{{n:3", None),
    (f"{OPEN}call:rm{{n:3}}", None),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
@pytest.mark.parametrize("pieces", [0, 1, 4])
def test_gemma_calls_read_alike_whole_and_in_pieces(text, expected, pieces):
    assert scan("gemma4", text, pieces) == (expected or (text, []))


def test_arguments_of_gemmas_notation():
    read = gemma_arguments(f"q:{quoted('a, b: {c}')},ok:false,w:None,l:[[1],{{}}],n:-2")
    assert read == {"q": "a, b: {c}", "ok": False, "w": None, "l": [[1], {}], "n": -2}
    assert gemma_arguments("") == {} and gemma_arguments(" ") == {}
    for broken in ["a", "a:", "a:1,,b:2", "a:{b:1", "a:[1", ":1", 'a:"x', "a:1 b:2}"]:
        assert gemma_arguments(broken) is None, broken
    assert gemma_arguments("a:{" * 100 + "}" * 100) is None  # deeper than any call's


def test_the_format_is_detected_from_the_chat_template():
    template = "{{- '<|tool_call>call:' + function['name'] + '{' -}}...{{- '}<tool_call|>' -}}"
    assert detect_parser(template) == "gemma4"


def test_grammars_write_calls_of_the_offered_functions_in_gemmas_notation():
    tokenizer, compiler = _marked(True, *MARKERS)
    form = tool_call_format("gemma4", None, tokenizer)
    assert len(form.marker_ids) == 3 and form.special_text  # Gemma's markers are special
    one = call("get_weather", f"city:{quoted('oslo')},unit:{quoted('c')}")
    two = one + call("calc", "")
    parallel = form.grammar(FUNCTIONS, parallel=True)
    single = form.grammar(FUNCTIONS, parallel=False)
    assert _accepts(tokenizer, compiler, parallel, one)
    assert _accepts(tokenizer, compiler, parallel, two)
    assert _accepts(tokenizer, compiler, single, one)
    assert not _accepts(tokenizer, compiler, single, two)
    for bad in [
        call("get_weather", f"unit:{quoted('c')}"),  # a required argument missing
        call("get_weather", f"unit:{quoted('c')},city:{quoted('oslo')}"),  # keys unsorted
        call("get_weather", f"city:{quoted('oslo')},unit:{quoted('k')}"),  # not in the enum
        call("get_weather", 'city:"oslo"'),  # not how the template writes a string
        call("rm", ""),  # not offered
        f"call:calc{{}}{CLOSE}",  # the call's marker is due
    ]:
        assert not _accepts(tokenizer, compiler, parallel, bad), bad
    content, calls = scan("gemma4", two)
    assert content == "" and [c.name for c in calls] == ["get_weather", "calc"]
    assert json.loads(calls[0].arguments) == {"city": "oslo", "unit": "c"}


TYPED = {
    "name": "book",
    "parameters": {
        "type": "object",
        "properties": {
            "when": {"type": "object", "properties": {"day": {"type": "integer"}}},
            "seats": {"type": "array", "items": {"type": "string"}},
            "vip": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 4},
            "code": {"type": "string", "pattern": "^[a-z]{2}$"},
            "either": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
        "required": ["code", "either", "note", "seats", "vip", "when"],
    },
}


@pytest.mark.parametrize("marked", [True, False], ids=["quote-token", "quote-text"])
def test_typed_arguments_written_by_the_grammar_read_back_as_their_schema_types(marked):
    if marked:
        tokenizer, compiler = _marked(True, *MARKERS)
    else:  # Gemma's quote as text (a tokenizer without the token)
        tokenizer = char_tokenizer(string.ascii_lowercase + string.digits + ' .,:;[]{}"<>_|^$')
        compiler = GrammarCompiler(tokenizer, len(tokenizer))
    source = tool_call_format("gemma4", None, tokenizer).grammar([TYPED], parallel=False)
    arguments = (
        f'code:"ab",either:null,note:{quoted("ab")},seats:[{quoted("a1")},{quoted("b2")}],'
        "vip:true,when:{day:3}"
    )
    assert _accepts(tokenizer, compiler, source, call("book", arguments))
    content, calls = scan("gemma4", call("book", arguments), schemas={"book": TYPED["parameters"]})
    assert content == "" and json.loads(calls[0].arguments) == {
        "code": "ab",
        "either": None,
        "note": "ab",
        "seats": ["a1", "b2"],
        "vip": True,
        "when": {"day": 3},
    }
    too_long = arguments.replace(quoted("ab"), quoted("abcde"), 1)
    assert not _accepts(tokenizer, compiler, source, call("book", too_long))


def test_keys_sorted_as_jinjas_dictsort_and_odd_ones_quoted_read_back():
    tokenizer = char_tokenizer(string.ascii_letters + string.digits + " ,:{}<>_|")
    tokenizer.add_tokens([AddedToken(m, special=True) for m in MARKERS], special_tokens=True)
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    odd = {
        "name": "calc",
        "parameters": {
            "type": "object",
            "properties": {
                "Zed": {"type": "integer"},
                "a b:c": {"type": "integer"},
                "n": {"type": "integer"},
            },
            "required": ["Zed", "a b:c", "n"],
        },
    }
    source = tool_call_format("gemma4", None, tokenizer).grammar([odd], parallel=False)
    # Gemma's template sorts keys with Jinja's dictsort, which ignores case.
    text = call("calc", f"{quoted('a b:c')}:1,n:2,Zed:3")
    assert _accepts(tokenizer, compiler, source, text)
    assert not _accepts(tokenizer, compiler, source, call("calc", "a b:c:1,n:2,Zed:3"))
    assert not _accepts(tokenizer, compiler, source, call("calc", f"Zed:3,{quoted('a b:c')}:1,n:2"))
    content, calls = scan("gemma4", text)
    assert content == "" and json.loads(calls[0].arguments) == {"a b:c": 1, "n": 2, "Zed": 3}


@pytest.mark.parametrize("pieces", [0, 1, 5])
def test_a_call_the_end_of_turn_closed_is_a_call_but_not_one_the_token_limit_cut(pieces):
    """Gemma 4 may end its turn where ``<tool_call|>`` was due (the end-of-turn token, not in
    the text, ends the reply): a whole call is read, with ``tool_calls`` as its finish; the
    same text cut by ``max_tokens`` keeps ``length`` and its text as content."""
    tools = [{"type": "function", "function": {"name": "calc"}}]
    text = f"Sure.\n{OPEN}call:calc{{n:3}}"
    for reason, content, finish in [("stop", "Sure.", "tool_calls"), ("length", text, "length")]:
        reply = ChatReply(None, tool_call_format("gemma4"), ToolPlan(tools, (), parallel=True))
        step = pieces or len(text)
        streamed = Piece()
        for at in range(0, len(text), step):
            streamed += reply.feed(text[at : at + step])
        streamed += reply.finish(reason)
        assert streamed.content == content and reply.finish_reason(reason) == finish
        assert [call["function"]["arguments"] for call in streamed.calls] == (
            ['{"n": 3}'] if reason == "stop" else []
        )
        whole = ChatReply(None, tool_call_format("gemma4"), ToolPlan(tools, (), parallel=True))
        message, whole_finish = whole.message(text, reason)
        assert whole_finish == finish and (message["content"] or "") == (
            "Sure." if reason == "stop" else text
        )
