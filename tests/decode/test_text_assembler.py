"""TextAssembler (osd.decode.generation): verified tokens in, text deltas out.

A client streams the deltas, so none may be taken back: text that could still become a stop
string, or that ends in part of a multi-byte character, waits for the tokens that settle it.
Checked with the character tokenizer of osd.testing (one character a token) and, for partial
characters, a byte-level tokenizer built the same way (one UTF-8 byte a token). That the
deltas do not depend on how tokens are grouped into steps is in ``test_stop_strings.py``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from osd.decode.generation import TextAssembler, text_decoder
from osd.testing import char_tokenizer

EOS = 1  # both tokenizers: <pad> 0, <eos> 1, then the characters or bytes


@pytest.fixture(scope="module")
def chars() -> PreTrainedTokenizerFast:
    return char_tokenizer()


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (id = byte + 2), decoded as GPT-2's byte-level BPE decodes:
    an incomplete character becomes U+FFFD."""
    from tokenizers import Tokenizer, decoders, models

    # GPT-2's printable stand-in for each byte (the characters the ByteLevel decoder maps back).
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    stand_in = {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}
    vocab = {"<pad>": 0, "<eos>": EOS, **{stand_in[b]: b + 2 for b in range(256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, "<pad>"))
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="module")
def utf8() -> PreTrainedTokenizerFast:
    return byte_tokenizer()


def byte_ids(text: str) -> list[int]:
    return [b + 2 for b in text.encode()]


def char_ids(tokenizer: Any, text: str) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids(c) for c in text]
    assert tokenizer.decode(ids) == text  # every character is in the vocabulary
    return ids


def deltas(assembler: TextAssembler, steps: list[list[int]]) -> list[tuple[str, int]]:
    """(text delta, tokens kept) of each step, stopping after a stop string as the engine does."""
    out = []
    for step in steps:
        out.append(assembler.add(step))
        if assembler.stopped:
            break
    return out


def test_without_stop_strings_each_token_text_is_emitted_at_once(chars):
    assembler = TextAssembler(chars, [])
    ids = char_ids(chars, "the cat")
    assert deltas(assembler, [[i] for i in ids]) == [(c, 1) for c in "the cat"]
    assert assembler.text == "the cat" and not assembler.stopped
    assert assembler.flush() == ""


def test_several_tokens_at_once_give_their_text_in_one_delta(chars):
    assembler = TextAssembler(chars, ["zz"])
    ids = char_ids(chars, "abc de")
    assert deltas(assembler, [ids[:4], ids[4:]]) == [("abc ", 4), ("de", 2)]


def test_special_tokens_add_no_text(chars):
    assembler = TextAssembler(chars, [])
    assert assembler.add([*char_ids(chars, "ab"), EOS]) == ("ab", 3)
    assert assembler.text == "ab"


def test_text_that_may_start_a_stop_string_is_held_until_settled(chars):
    assembler = TextAssembler(chars, ["end."])
    steps = [char_ids(chars, s) for s in ("the ", "e", "n", "d", "s")]
    # "e", "en", "end" could each begin "end."; the "s" shows they do not.
    assert deltas(assembler, steps) == [("the ", 4), ("", 1), ("", 1), ("", 1), ("ends", 1)]
    assert not assembler.stopped and assembler.text == "the ends"


def test_held_back_text_is_released_by_flush_at_the_end(chars):
    assembler = TextAssembler(chars, ["end."])
    assert assembler.add(char_ids(chars, "the en")) == ("the ", 6)
    assert assembler.flush() == "en"
    assert assembler.flush() == ""  # nothing is given twice


def test_only_the_longest_partial_stop_is_held(chars):
    # "abab" ends in "ab" (a start of "abc") but "ab" is all that could still be one.
    assembler = TextAssembler(chars, ["abc", "bx"])
    assert assembler.add(char_ids(chars, "abab")) == ("ab", 4)
    assert assembler.add(char_ids(chars, "a")) == ("ab", 1)  # now "a" is the start held


def test_the_text_is_cut_before_a_stop_string_and_generation_stops(chars):
    assembler = TextAssembler(chars, ["end"])
    steps = [char_ids(chars, s) for s in ("one e", "nd two", "three")]
    assert deltas(assembler, steps) == [("one ", 5), ("", 2)]  # "two" never reaches the text
    assert assembler.stopped and assembler.text == "one "
    assert assembler.flush() == ""  # the stop string itself is never emitted


def test_tokens_after_the_one_completing_a_stop_string_are_not_kept(chars):
    # A speculative step verifies several tokens; generation ends at the one completing "d!".
    assembler = TextAssembler(chars, ["d!"])
    assert assembler.add(char_ids(chars, "good! more")) == ("goo", 5)
    assert assembler.stopped


def test_a_stop_string_completed_by_the_first_token(chars):
    assembler = TextAssembler(chars, ["x"])
    assert assembler.add(char_ids(chars, "xyz")) == ("", 1)
    assert assembler.stopped and assembler.text == ""


def test_the_earliest_stop_string_in_the_text_wins(chars):
    # Both complete in the same step; the text ends before the one that begins first.
    assembler = TextAssembler(chars, ["cd", "bcd"])
    assert assembler.add(char_ids(chars, "abcdef")) == ("a", 4)  # both completed at "d"
    assert assembler.text == "a"


def test_an_empty_stop_string_is_ignored(chars):
    assembler = TextAssembler(chars, ["", "zz"])
    assert assembler.add(char_ids(chars, "abc")) == ("abc", 3)
    assert not assembler.stopped


def test_without_a_tokenizer_tokens_pass_with_no_text():
    assembler = TextAssembler(None, ["stop"])
    assert assembler.add([5, 6, 7]) == ("", 3)
    assert not assembler.stopped and assembler.flush() == ""


@pytest.mark.parametrize("text", ["é", "😀", "日本", "a€b"])
def test_a_partial_multi_byte_character_is_held_until_complete(utf8, text):
    assembler = TextAssembler(utf8, [])
    out = [assembler.add([i])[0] for i in byte_ids(text)]
    assert "".join(out) == text
    assert all("\ufffd" not in delta for delta in out), out
    for delta in out:  # each delta is whole characters, emitted with their last byte
        assert delta == "" or delta.encode().decode() == delta


def test_a_stop_string_after_multi_byte_characters(utf8):
    assembler = TextAssembler(utf8, ["ße"])  # a stop string with a two-byte character
    steps = [[i] for i in byte_ids("grüße! mehr")]
    out = deltas(assembler, steps)
    assert "".join(delta for delta, _ in out) == "grü"
    assert sum(num_kept for _, num_kept in out) == len("grüße".encode())
    assert assembler.stopped and assembler.flush() == ""


def test_deltas_and_flush_always_add_up_to_the_decoded_text(utf8):
    """Whatever the bytes (invalid ones too) and steps: nothing lost, nothing said twice."""
    rng = random.Random(0)
    samples = ["plain", "é😀日", "aÿb"]
    for _ in range(200):
        text = rng.choice(samples) + "".join(rng.choice("ab€ ") for _ in range(rng.randint(0, 6)))
        ids = byte_ids(text) + ([0x80 + 2] if rng.random() < 0.3 else [])  # a stray byte
        assembler = TextAssembler(utf8, ["€ b"])
        out, position = "", 0
        while position < len(ids) and not assembler.stopped:
            size = rng.randint(1, 4)
            out += assembler.add(ids[position : position + size])[0]
            position += size
        out += assembler.flush()
        assert out == assembler.text
        if not assembler.stopped:
            assert out == utf8.decode(ids), (text, out)


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Words with SentencePiece's "▁" for a leading space, decoded as Llama's tokenizer does:
    the first token of a decode loses its space, so a decode that starts mid-text differs from
    the whole text's decode at its start."""
    from tokenizers import Tokenizer, decoders, models

    words = ["a", "b", "cd", "ef", "é", ",", "!"]
    pieces = [*words, *[f"▁{w}" for w in words]]
    vocab = {"<pad>": 0, "<eos>": EOS, **{p: i + 2 for i, p in enumerate(pieces)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, "<pad>"))
    tokenizer.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


@pytest.mark.parametrize("kind", ["bytes", "metaspace"])
def test_long_generations_decode_incrementally_to_the_whole_decode(kind, utf8):
    """Past the decode window (32 tokens), in steps of any size, with and without a stop
    string: the text is the whole sequence's decode, the deltas add up to it."""
    tokenizer = utf8 if kind == "bytes" else metaspace_tokenizer()
    vocab = range(2, 258) if kind == "bytes" else range(2, 16)
    rng = random.Random(1)
    for trial in range(60):
        ids = [rng.choice(vocab) for _ in range(rng.randint(40, 300))]
        if kind == "bytes":  # mostly valid UTF-8: multi-byte characters across the window
            ids = byte_ids("".join(rng.choice("ab é€😀") for _ in range(len(ids) // 2)))
        stop = ["€ é"] if trial % 3 == 0 else []
        assembler = TextAssembler(tokenizer, stop)
        out, kept, position = "", [], 0
        while position < len(ids) and not assembler.stopped:
            step = ids[position : position + rng.randint(1, 9)]
            delta, num_kept = assembler.add(step)
            out, kept, position = out + delta, kept + step[:num_kept], position + len(step)
        out += assembler.flush()
        assert out == assembler.text
        whole = tokenizer.decode(kept, skip_special_tokens=True)
        if assembler.stopped:
            assert whole.startswith(out) and whole[len(out) :].startswith(stop[0])
        else:
            assert out == whole


def test_text_decoder_is_the_tokenizers_decode(chars: PreTrainedTokenizerFast) -> None:
    """The backend shortcut decodes exactly as ``tokenizer.decode(ids, skip_special_tokens=
    True)`` (special tokens dropped, partial characters as U+FFFD), and a tokenizer whose decode
    does more (cleaning up spaces) keeps its own decode."""
    utf8 = byte_tokenizer()
    cases = [
        (chars, [EOS, *char_ids(chars, "a b, c."), EOS, 0]),
        (utf8, [EOS, *byte_ids("né ✓")[:-1]]),
        (utf8, byte_ids("日本")),
    ]
    for tokenizer, ids in cases:
        assert text_decoder(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    cleaning = char_tokenizer()
    cleaning.clean_up_tokenization_spaces = True
    spaced = char_ids(chars, "a , b .")  # the same vocabulary
    shortcut = cleaning.backend_tokenizer.decode(spaced, skip_special_tokens=True)
    assert text_decoder(cleaning)(spaced) == cleaning.decode(spaced, skip_special_tokens=True)
    assert text_decoder(cleaning)(spaced) != shortcut  # the control: cleaning changed the text
