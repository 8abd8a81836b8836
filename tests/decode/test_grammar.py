"""Grammar compilation (osd.decode.grammar): every kind compiles or fails with a clear error, the
cache, the packed masks, and both ways of reading a vocabulary (a byte-level BPE tokenizer that
llguidance reads itself, a character tokenizer it reads token by token)."""

from __future__ import annotations

import json

import pytest
import torch

from osd import SpeculativeDecoder
from osd.decode.grammar import MAX_GRAMMAR_CHARS, GrammarCompiler, unpack_bitmask
from osd.testing import char_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(char_tokenizer(), vocab_size=64)


def allowed_after(compiler: GrammarCompiler, grammar, text: str) -> set[str]:
    tokenizer = char_tokenizer()
    matcher = grammar.matcher()
    assert matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    mask = unpack_bitmask(bits, 64)
    return {tokenizer.convert_ids_to_tokens(i) for i in mask.nonzero().flatten().tolist()}


def test_masks_follow_the_grammar(compiler):
    grammar = compiler.compile("regex", "[ab]c|d")
    assert allowed_after(compiler, grammar, "") == {"a", "b", "d"}
    assert allowed_after(compiler, grammar, "a") == {"c"}
    assert allowed_after(compiler, grammar, "ac") == {"<eos>"}
    choice = compiler.compile("choice", ["yes", "no"])
    assert allowed_after(compiler, choice, "") == {"y", "n"}


def test_gbnf_grammars_are_read_as_vllm_reads_them(compiler):
    # llama.cpp's GBNF, which vLLM's default (xgrammar) backend takes, beside Lark.
    grammar = compiler.compile("lark", 'root ::= "yes" | "no" | item+\nitem ::= [a-c] "!"')
    assert allowed_after(compiler, grammar, "") == {"y", "n", "a", "b", "c"}
    assert allowed_after(compiler, grammar, "b") == {"!"}
    assert allowed_after(compiler, grammar, "b!") == {"a", "b", "c", "<eos>"}
    # Lark stays Lark, its inlined ?start included (vLLM's own Lark examples begin so).
    inlined = compiler.compile("lark", '?start: "a" | "b"')
    assert allowed_after(compiler, inlined, "") == {"a", "b"}


@pytest.mark.parametrize(
    ("kind", "spec", "answer"),
    [
        ("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":5}'),
        ("regex", "[0-9]+", "42"),
        ("choice", ["yes", "no"], "no"),
        ("lark", 'start: "ok" | "no"', "ok"),
    ],
)
def test_a_grammar_can_hold_after_a_reasoning_models_thinking(compiler, kind, spec, answer):
    grammar = compiler.compile(kind, spec, thinking_first=True)
    assert grammar.thinks and not compiler.compile(kind, spec).thinks
    tokenizer = char_tokenizer()

    def accepts(text: str) -> bool:
        matcher = grammar.matcher()
        ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        return bool(ok) and bool(matcher.is_accepting())

    assert accepts(f"2 < 3, <b>so</think>\n\n{answer}") and accepts(f"</think>{answer}")
    assert not accepts(answer)  # the thinking, even empty, ends first
    assert not accepts(f"a</think>\n{answer}</think>")  # thinking ends at its first </think>
    # While thinking, any text; after it, the grammar's.
    assert len(allowed_after(compiler, grammar, "2 <")) > 40
    assert allowed_after(compiler, grammar, "x</think>\n") == allowed_after(
        compiler, compiler.compile(kind, spec), ""
    ) | {"\n", " "}


def test_matchers_are_independent_and_grammars_cached(compiler):
    grammar = compiler.compile("json_object")
    assert compiler.compile("json_object") is grammar
    first, second = grammar.matcher(), grammar.matcher()
    assert first.consume_token(char_tokenizer().convert_tokens_to_ids("{"))
    assert allowed_after(compiler, grammar, "") == {"{"}  # the prototype never moves
    assert second.is_accepting() is False


@pytest.mark.parametrize(
    ("kind", "spec", "words"),
    [
        ("regex", "[ab", "does not compile"),
        ("lark", "start: missing", "does not compile"),
        ("lark", 'root ::= "a" (', "GBNF grammar does not convert"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", ["a list"], "JSON object"),
        ("choice", [], "non-empty list"),
        ("choice", "yes", "non-empty list"),
        ("regex", "", "non-empty string"),
        ("regex", "a" * (MAX_GRAMMAR_CHARS + 1), "at most"),
        ("xml", None, "must be one of"),
    ],
)
def test_bad_grammars_are_clear_errors(compiler, kind, spec, words):
    with pytest.raises(ValueError, match=words):
        compiler.compile(kind, spec)


def test_unpack_bitmask_bit_order():
    bits = torch.tensor([[1 - 2**31, 0b10]], dtype=torch.int32)  # bits 0 and 31 of word 0
    mask = unpack_bitmask(bits, 40)
    assert mask.shape == (1, 40)
    assert mask[0].nonzero().flatten().tolist() == [0, 31, 33]


def test_byte_level_bpe_tokenizer(tmp_path):
    """A byte-level BPE vocabulary (as the demo's and most real models'): JSON under a schema
    parses when tokens span several characters."""
    from osd.demo.recipe import TokenizerRecipe
    from osd.demo.vocab import train_tokenizer

    texts = ['{"name": "alpha", "size": 12}', '{"name": "beta", "size": 7}'] * 50
    tokenizer = train_tokenizer(texts, TokenizerRecipe(vocab_size=300, min_frequency=2))
    vocab = len(tokenizer)
    target = tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=1, seed=1, logit_scale=2.0)
    draft = tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=1, seed=2, logit_scale=2.0)
    decoder = SpeculativeDecoder(target, draft, tokenizer)
    schema = {
        "type": "object",
        "properties": {"name": {"enum": ["alpha", "beta"]}, "size": {"type": "boolean"}},
        "required": ["name", "size"],
        "additionalProperties": False,
    }
    grammar = decoder.grammars.compile("json_schema", schema)
    for seed in range(3):
        result = decoder.generate(
            '{"', max_tokens=40, seed=seed, grammar=grammar, method="block", log=False
        )
        assert result.finish_reason == "stop", result.text
        value = json.loads(result.text)
        assert value["name"] in ("alpha", "beta") and isinstance(value["size"], bool)


@pytest.mark.parametrize("reading", ["byte-level BPE", "characters"])
def test_an_added_token_that_is_not_special_is_named_by_its_id(reading):
    """Qwen3's ``</think>`` and DeepSeek's tool-call markers are added tokens but not special
    ones. llguidance reads every added token as a token no grammar text can spell, in both
    ways of reading a vocabulary; a thinking-first grammar names ``</think>`` by its id, so the
    model's own token ends the thinking."""
    from tokenizers import AddedToken

    from osd.demo.recipe import TokenizerRecipe
    from osd.demo.vocab import train_tokenizer

    if reading == "characters":
        tokenizer = char_tokenizer()
    else:
        texts = ["so 2 < 3, and ok or no"] * 50
        tokenizer = train_tokenizer(texts, TokenizerRecipe(vocab_size=300, min_frequency=2))
    tokenizer.add_tokens([AddedToken("</think>", special=False)])
    end = tokenizer.convert_tokens_to_ids("</think>")
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    grammar = compiler.compile("lark", 'start: "ok" | "no"', thinking_first=True)

    def accepts(ids: list[int]) -> bool:
        matcher = grammar.matcher()
        return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())

    thought = tokenizer.encode("so 2 < 3", add_special_tokens=False)
    answer = tokenizer.encode("ok", add_special_tokens=False)
    assert accepts([*thought, end, *answer])
    assert not accepts([*thought, *answer])
    # Written as text the grammar does not take it: the text is not the token.
    matcher = compiler.compile("lark", 'start: "</think>" "ok"').matcher()
    assert not matcher.consume_tokens([end])


@pytest.mark.parametrize("method", ["token", "block", "spectr"])
def test_grammar_text_that_is_an_added_tokens_text_decodes(method):
    """A client's grammar writes ``</think>`` as text where the tokenizer has it as an added
    token that is not special (Qwen3's): llguidance's mask allows that token alone there and its
    parser refuses it; the parser reads it as its text, and the reply is the grammar's."""
    from tokenizers import AddedToken

    tokenizer = char_tokenizer()
    tokenizer.add_tokens([AddedToken("</think>", special=False)])
    vocab = len(tokenizer)
    target = tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=1, seed=1, logit_scale=2.0)
    draft = tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=1, seed=2, logit_scale=2.0)
    decoder = SpeculativeDecoder(target, draft, tokenizer)
    grammar = decoder.grammars.compile("lark", 'start: "so </think> ok"')
    assert set(grammar.spelled) == {64}
    for seed in range(2):
        result = decoder.generate(
            "x",
            max_tokens=20,
            grammar=grammar,
            method=method,
            num_spec_tokens=3,
            seed=seed,
            log=False,
        )
        assert (result.finish_reason, result.text) == ("stop", "so </think> ok")
