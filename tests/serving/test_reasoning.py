"""Reasoning models' thinking read apart from their answer (serving.reasoning): the same whole
and piece by piece, wherever the thinking is opened (by the prompt, by the reply, or by
DeepSeek-R1's models without the marker), and the answer's text never taken for thinking."""

from __future__ import annotations

import pytest

from serving.reasoning import (
    REASONING_PARSERS,
    ReasoningReader,
    detect_reasoning,
    prompt_opens_thinking,
)


def read(text: str, opened: bool = False, parser: str = "qwen3", pieces: int = 0):
    """(thinking, answer, whether it thought) of ``text`` fed whole or in pieces."""
    reader = ReasoningReader(parser, opened)
    thinking, answer = "", ""
    step = pieces or len(text) or 1
    for at in range(0, len(text), step):
        more, said = reader.feed(text[at : at + step])
        thinking, answer = thinking + more, answer + said
    more, said = reader.finish()
    return thinking + more, answer + said, reader.thought


CASES = [
    # (reply, prompt opened <think>, parser) -> (thinking, answer, thought)
    (("<think>\nhmm, 2 < 3\n</think>\n\nHello", False, "qwen3"), ("hmm, 2 < 3", "Hello", True)),
    (("hmm\n\nso\n</think>\n\nHi", True, "qwen3"), ("hmm\n\nso", "Hi", True)),
    # Cut before </think>: all thinking.
    (("still thinking", True, "qwen3"), ("still thinking", "", True)),
    (("<think>still", False, "qwen3"), ("still", "", True)),
    # Thinking that said nothing.
    (("<think>\n\n</think>\n\nHi", False, "qwen3"), ("", "Hi", False)),
    # Not opened by the prompt nor at the reply's start: all answer.
    (("Hello <think>x</think>", False, "qwen3"), ("", "Hello <think>x</think>", False)),
    (("Hi</think>there", False, "qwen3"), ("", "Hi</think>there", False)),
    (("  <thi", False, "qwen3"), ("", "  <thi", False)),
    (("", False, "qwen3"), ("", "", False)),
    # DeepSeek-R1's models may leave <think> out: thinking up to </think>.
    (("reason</think>answer", False, "deepseek_r1"), ("reason", "answer", True)),
    (("<think>reason</think>answer", False, "deepseek_r1"), ("reason", "answer", True)),
    # The answer keeps its own whitespace and markup, but not what follows </think>.
    (("<think>a</think>\n\n  x\n</think>", False, "qwen3"), ("a", "x\n</think>", True)),
    # Gemma 4's channel, its name ("thought") the format's; the reply opens it or does not.
    (
        ("<|channel>thought\nhmm, 2 < 3<channel|>Hello", False, "gemma4"),
        ("hmm, 2 < 3", "Hello", True),
    ),
    (("<|channel>thought\n<channel|>Hi", False, "gemma4"), ("", "Hi", False)),
    (("<|channel>musing<channel|>Hi", False, "gemma4"), ("musing", "Hi", True)),
    (("<|channel>thought\nstill", False, "gemma4"), ("still", "", True)),
    (("thought about it", False, "gemma4"), ("", "thought about it", False)),
    # The channel's name without its opening, as some checkpoints write it (vLLM reads it so).
    (("thought\nhmm<channel|>Hi", False, "gemma4"), ("hmm", "Hi", True)),
    (("thought\nhmm", False, "gemma4"), ("hmm", "", True)),
    (("thought", False, "gemma4"), ("", "thought", False)),
    (("thoughtful", False, "gemma4"), ("", "thoughtful", False)),
    (("thought\nx", False, "qwen3"), ("", "thought\nx", False)),
    (("<think>x</think>y", False, "gemma4"), ("", "<think>x</think>y", False)),
]


@pytest.mark.parametrize(("given", "expected"), CASES)
@pytest.mark.parametrize("pieces", [0, 1, 3])
def test_thinking_reads_alike_whole_and_in_pieces(given, expected, pieces):
    text, opened, parser = given
    assert read(text, opened, parser, pieces) == expected


def test_thinking_streams_as_it_comes_holding_back_only_a_possible_marker():
    reader = ReasoningReader("qwen3", opened=True)
    assert reader.feed("\nfirst ") == ("first", "")  # the space may end the thinking: waits
    assert reader.feed("second</thi") == (" second", "")
    assert reader.feed("nk>\n\n") == ("", "")
    assert reader.feed("Answer") == ("", "Answer")


@pytest.mark.parametrize(
    ("tail", "opened"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<｜Assistant｜><think>", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking false
        ("<|im_start|>assistant\n", False),
    ],
)
def test_a_prompt_that_opens_thinking_is_told_apart(tail, opened):
    assert prompt_opens_thinking(tail) is opened
    assert not prompt_opens_thinking(tail, "gemma4")  # Gemma 4's replies open their channel


def test_the_config_takes_exactly_the_parsers_the_server_reads():
    from osd.config import REASONING_PARSERS as TAKEN

    assert {*REASONING_PARSERS, "openai_gptoss"} == set(TAKEN)  # (harmony's: serving.harmony)


def test_the_parser_is_detected_from_the_chat_template():
    assert detect_reasoning("{{ '<think>' }}...{{ '</think>' }}") == "qwen3"
    assert detect_reasoning("{{ '<|channel>thought\\n' + t + '<channel|>' }}") == "gemma4"
    assert detect_reasoning("{{ messages }}") is None and detect_reasoning(None) is None
    with pytest.raises(ValueError, match="reasoning_parser"):
        ReasoningReader("granite", False)
