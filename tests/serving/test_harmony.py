"""gpt-oss's harmony replies (serving.harmony): thinking, content and tool calls read alike whole
and piece by piece, whichever order a call's header takes; what is not harmony is content."""

from __future__ import annotations

import pytest

from osd.decode.grammar import GrammarCompiler
from serving.harmony import HarmonyReader
from serving.tool_parsers import ParsedCall, speaks_harmony, tool_call_format
from tests.serving.test_harmony_api import harmony_tokenizer

NAMES = ("get_weather", "calc")
THINK = "<|channel|>analysis<|message|>we need 2 < 3 <b><|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>the answer"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "sf"}'
SF = ParsedCall("get_weather", '{"city": "sf"}')


def read(text: str, pieces: int = 0, names=NAMES, parallel: bool = True):
    reader = HarmonyReader(names, parallel)
    thinking, content, calls = "", "", []
    step = pieces or len(text) or 1
    for at in range(0, len(text), step):
        more, said, made = reader.feed(text[at : at + step])
        thinking, content, calls = thinking + more, content + said, calls + made
    more, said, made = reader.finish()
    return thinking + more, content + said, calls + made


CASES = [
    (THINK + FINAL, ("we need 2 < 3 <b>", "the answer", [])),
    (THINK + "<|start|>assistant" + CALL, ("we need 2 < 3 <b>", "", [SF])),
    # The recipient before the channel, as gpt-oss's template writes an earlier call.
    (
        '<|start|>assistant to=functions.calc<|channel|>commentary json<|message|>{"n": 7}',
        ("", "", [ParsedCall("calc", '{"n": 7}')]),
    ),
    # The recipient first without <|start|>: the reply goes on from the prompt's assistant.
    (
        ' to=functions.calc<|channel|>commentary json<|message|>{"n": 7}',
        ("", "", [ParsedCall("calc", '{"n": 7}')]),
    ),
    # A message whose end the model left out: the next header ends it.
    (
        "<|channel|>analysis<|message|>a<|channel|>final<|message|>b",
        ("a", "b", []),
    ),
    # What only looks like a marker's start is text.
    ("<|channel|>final<|message|>x <| y<|end|>", ("", "x <| y", [])),
    # A preamble (commentary without a recipient) is content.
    (
        "<|channel|>commentary<|message|>let me check.<|end|><|start|>assistant" + CALL,
        ("", "let me check.", [SF]),
    ),
    # A call of a function not offered, or whose body is no JSON object: its text.
    (
        "<|channel|>commentary to=functions.rm <|constrain|>json<|message|>{}",
        ("", "{}", []),
    ),
    (CALL.replace('{"city": "sf"}', "[1]"), ("", "[1]", [])),
    # Cut while thinking, or in a header: what was said.
    ("<|channel|>analysis<|message|>cut sh", ("cut sh", "", [])),
    (THINK + "<|start|>assistant<|chan", ("we need 2 < 3 <b>", "", [])),
    # Not harmony at all: content, without the format's markers.
    ("plain words", ("", "plain words", [])),
    ("plain<|end|> words<|call|>", ("", "plain words", [])),
    ("", ("", "", [])),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
@pytest.mark.parametrize("pieces", [0, 1, 2, 5, 7])
def test_replies_read_alike_whole_and_in_pieces(text, expected, pieces):
    assert read(text, pieces) == expected


def test_without_tools_a_call_is_content_and_parallel_false_keeps_the_first():
    assert read(CALL, names=())[2] == []
    two = CALL + "<|call|><|start|>assistant" + CALL
    assert read(two, parallel=False)[2] == [SF]


def test_the_forced_call_grammar_writes_one_call_through_the_special_markers():
    tokenizer = harmony_tokenizer()
    form = tool_call_format("openai", None, tokenizer)
    assert {piece for piece, _ in form.marker_ids} == {
        "<|channel|>",
        "<|constrain|>",
        "<|message|>",
    }
    functions = [
        {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
        {"name": "calc"},
    ]
    source = form.grammar(functions, parallel=True)
    matcher = GrammarCompiler(tokenizer, len(tokenizer)).compile("lark", source).matcher()
    ids = tokenizer(CALL, add_special_tokens=False)["input_ids"]
    assert matcher.consume_tokens(ids) and matcher.is_accepting()
    assert read(CALL) == ("", "", [SF])


def test_a_harmony_template_is_told_apart():
    assert speaks_harmony("<|start|>{{ x }}<|channel|>final<|message|>{{ y }}<|call|>")
    assert not speaks_harmony("<tool_call>") and not speaks_harmony(None)


def test_a_harmony_reply_without_tools_or_a_tool_format_reads_and_the_parser_is_configurable():
    from osd.config import load_config
    from serving.chat_replies import ChatReply

    reply = ChatReply(None, None, None, True, harmony=True)  # serve.tool_call_parser=none
    message, finish = reply.message(THINK + FINAL, "stop")
    assert (message["content"], message["reasoning"], finish) == (
        "the answer",
        "we need 2 < 3 <b>",
        "stop",
    )
    config = load_config(None, ["serve.tool_call_parser=openai"])
    assert config.serve.tool_call_parser == "openai"
