"""Structured output: grammars compiled to token masks that draft and target both obey.

A grammar (a JSON schema, any JSON object, a regular expression, a Lark grammar or a list of
choices) is compiled once per request by llguidance (Microsoft's Rust grammar engine; chosen
over xgrammar because its CPU wheel has no dependencies, where xgrammar's pulls a 1 GB
``triton``, and its masks are computed on the host for any device, incrementally per token, on
matchers that copy in a microsecond). Each row keeps a matcher, advanced by the tokens it
emits. The mask at a position depends only on the tokens before it, like the penalties, so
applying it to the draft's q and the target's p keeps every verifier exact: the output
distribution is the target's distribution restricted to the grammar and renormalised at every
token (``osd.decode.sampling.rows_to_probs``).

Compiling is the expensive part (up to about a second for a large schema on a large
vocabulary), so it happens in the request's thread before the request reaches the decode loop,
and compiled grammars are cached by their source.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from osd.decode.models import added_token_ids

__all__ = [
    "GRAMMAR_KINDS",
    "Grammar",
    "GrammarCompiler",
    "GrammarFailed",
    "consume",
    "unpack_bitmask",
]

GrammarKind = Literal["json_object", "json_schema", "regex", "lark", "choice"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "lark", "choice")
MAX_GRAMMAR_CHARS = 64_000  # a request's schema, regex or grammar text
_CACHE_SIZE = 64

# JSON is generated compactly: flexible whitespace would let a weak model spend its whole
# budget on spaces and newlines inside a valid object.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions


class GrammarFailed(RuntimeError):
    """A request's grammar gave up while it decoded: it asks for text the models' vocabulary
    cannot write (a toy vocabulary without capitals asked for ``[A-Z]``), or llguidance met
    one of its resource limits. Compiling cannot always foresee either; the request fails, the
    batch goes on."""


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar; :meth:`matcher` gives each request its own parser state.

    Attributes:
        kind: what it was compiled from (``GRAMMAR_KINDS``).
        source: the llguidance grammar text it was compiled to.
        thinks: the output is a reasoning model's thinking, any text up to ``</think>``, then
            the grammar's (``compile``'s ``thinking_first``).
        spelled: the tokenizer's added tokens that are not special (Qwen's ``<tool_call>``),
            each with its text as ordinary tokens. llguidance 1.9 reads such a token as one no
            grammar text spells, yet where the grammar's next text is the token's text its
            mask allows that token alone, and its parser then refuses it: :func:`consume`
            gives the parser the text instead.
    """

    kind: str
    source: str
    _prototype: Any = field(repr=False)
    thinks: bool = False
    spelled: Mapping[int, list[int]] = field(default_factory=dict, repr=False)

    def matcher(self) -> Any:
        """A fresh ``llguidance.LLMatcher`` at the start of the grammar."""
        return self._prototype.deep_copy()


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary; safe to share between threads.

    Args:
        tokenizer: the models' Hugging Face tokenizer.
        vocab_size: the models' vocabulary (may exceed the tokenizer's; the extra ids are
            never allowed).
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        if tokenizer is None:
            raise ValueError("structured output needs the models' tokenizer")
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("structured output needs a tokenizer with an end-of-sequence token")
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._tokenizer = _ll_tokenizer(tokenizer, vocab_size)
        added = added_token_ids(tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", []))
        self._spelled = {
            i: self._tokenizer.greedy_tokenize(text)
            for text, i in added.items()
            if i not in special and i < vocab_size
        }
        # Tokens a thinking-first grammar names: </think> where it is an added token (Qwen3's,
        # R1's), and harmony's markers (gpt-oss's, where the thinking is the analysis channel).
        self._think_end = added.get("</think>")
        harmony = [added.get(m) for m in _HARMONY]
        self._harmony = None if None in harmony else dict(zip(_HARMONY, harmony, strict=True))
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, spec: Any = None, thinking_first: bool = False) -> Grammar:
        """Compiles one grammar.

        Args:
            kind: ``json_object`` (any JSON object; ``spec`` unused), ``json_schema`` (``spec``:
                the schema, a dict or its JSON text), ``regex`` (``spec``: the pattern the
                whole output matches), ``lark`` (``spec``: a Lark grammar with a ``start``
                rule, or a GBNF grammar with a ``root`` rule, converted) or ``choice``
                (``spec``: the strings the output must be one of).
            thinking_first: the output first thinks, free text up to ``</think>`` (a
                reasoning model whose prompt opened ``<think>``), and the grammar holds after
                it and the whitespace that follows, as vLLM applies a grammar after reasoning.

        Raises:
            ValueError: an unknown kind, or a spec that does not compile (the message says
                why).
        """
        import llguidance

        source = _grammar_source(kind, spec)
        if thinking_first:
            source = _after_thinking(source, self._thinking_first())
        if len(source) > MAX_GRAMMAR_CHARS * 4:
            raise ValueError(f"the {kind} grammar is too large")
        key = (kind, source)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        matcher = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        matcher.compute_bitmask()  # the first mask too: some limits are only met computing it
        if matcher.is_error():
            raise ValueError(f"the {kind} does not compile: {_first_line(matcher.get_error())}")
        grammar = Grammar(kind, source, matcher, thinking_first, self._spelled)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _thinking_first(self) -> str:
        """The Lark grammar of the thinking before the answer: harmony's analysis channel
        where the tokenizer has its markers, else text up to ``</think>`` (named by its id
        where it is an added token)."""
        if self._harmony is not None:
            ids = self._harmony
            return _THINKING_FIRST_HARMONY.format(
                c=ids["<|channel|>"], m=ids["<|message|>"], e=ids["<|end|>"], s=ids["<|start|>"]
            )
        if self._think_end is not None:
            return _THINKING_FIRST_SPECIAL.format(id=self._think_end)
        return _THINKING_FIRST


def consume(matcher: Any, token: int, grammar: Grammar | None) -> bool:
    """``matcher`` (of ``grammar``) consumes ``token``; an added token that is not special,
    where the parser would refuse it, as its text (``Grammar.spelled``). False: the parser
    refused it."""
    spelled = None if grammar is None else grammar.spelled.get(token)
    if spelled is not None and not matcher.validate_tokens([token]):
        return bool(matcher.consume_tokens(spelled))
    return bool(matcher.consume_token(token))


def _grammar_source(kind: str, spec: Any) -> str:
    import llguidance

    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
    if kind == "json_schema":
        if isinstance(spec, str):
            spec = _json_text(spec)
        if not isinstance(spec, dict):
            raise ValueError("the json_schema must be a JSON object")
        _check_size(json.dumps(spec), kind)
        return llguidance.LLMatcher.grammar_from_json_schema(spec, _JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(_text(spec, kind))
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(_lark(_text(spec, kind)))
    if kind == "choice":
        if not isinstance(spec, Sequence) or isinstance(spec, str) or not spec:
            raise ValueError("choice must be a non-empty list of strings")
        choices = [_text(c, kind) for c in spec]
        _check_size("".join(choices), kind)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices)
        )
    raise ValueError(f"grammar kind must be one of {list(GRAMMAR_KINDS)}, got {kind!r}")


# Any text up to and with </think> (llguidance's stop ends the lexeme at its first match),
# the whitespace after it, then the grammar, by name.
_THINKING_FIRST = (
    'start: thinking WS? @answer\nthinking[stop="</think>"]: /(?s:.*)/\nWS: /[ \\t\\r\\n]+/\n'
)
# Where </think> is an added token: any text (which cannot spell it), then the token.
_THINKING_FIRST_SPECIAL = (
    "start: TEXT? <[{id}]> WS? @answer\nTEXT: /(?s:.+)/\nWS: /[ \\t\\r\\n]+/\n"
)


_HARMONY = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
# gpt-oss's: an optional analysis message, then the final channel's message is the grammar's.
_THINKING_FIRST_HARMONY = (
    'start: analysis? <[{c}]> "final" <[{m}]> @answer\n'
    'analysis: <[{c}]> "analysis" <[{m}]> TEXT? <[{e}]> <[{s}]> "assistant"\n'
    "TEXT: /(?s:.+)/\n"
)


def _after_thinking(source: str, lark: str) -> str:
    """``source`` (llguidance's grammars as JSON, or Lark text) after a reasoning model's
    thinking, as ``lark`` (whose ``@answer`` is the grammar) writes it."""
    try:
        top = json.loads(source)
    except ValueError:
        top = None
    if isinstance(top, dict) and top.get("grammars"):
        grammars = top["grammars"]
    else:
        grammars = [{"lark_grammar": source}]
    answer = {**grammars[0], "name": "answer"}
    first = {"name": "thinking_first", "lark_grammar": lark}
    return json.dumps({"grammars": [first, answer, *grammars[1:]]})


def _lark(text: str) -> str:
    """``text`` in Lark syntax: a GBNF grammar (llama.cpp's ``root ::= ...``, which vLLM's
    xgrammar backend takes) is converted by llguidance's converter; Lark (any grammar without a
    ``::=`` rule, or with a ``start`` rule) is left alone."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if is_lark_syntax(text) or not _GBNF_RULE.search(text):
        return text
    try:
        return gbnf_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the converter raises its own and others
        raise ValueError(f"the GBNF grammar does not convert: {exc}") from None


_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z][\w-]*\s*::=")


def _json_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the json_schema is not valid JSON: {exc}") from None


def _text(spec: Any, kind: str) -> str:
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"the {kind} must be a non-empty string")
    _check_size(spec, kind)
    return spec


def _check_size(text: str, kind: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the {kind} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")


def _first_line(message: str) -> str:
    """The error's first line; where it only announces what follows (a regex error's
    "regex parse error:", then the pattern, a caret and "error: ..."), with its "error" line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    said = [line for line in lines[1:] if line.lower().startswith("error")]
    return f"{lines[0]} {said[0]}" if lines[0].endswith(":") and said else lines[0]


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the vocabulary: from the fast tokenizer's own description when
    llguidance understands it (byte-level BPE, SentencePiece), else from each token's text."""
    import llguidance
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    except ValueError:
        pass
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_TokenTexts(tokenizer, vocab_size)), n_vocab=vocab_size
    )


class _TokenTexts:
    """The duck-typed tokenizer llguidance.TokenizerWrapper reads: each token's bytes, from its
    vocabulary entry (SentencePiece's word marker as a space, ``<0xNN>`` as that byte), not from
    decoding it alone, which drops a leading space and turns a lone byte into U+FFFD; an added
    token's text as it is (DeepSeek's ``<｜tool▁sep｜>`` keeps its ``▁``)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        known = len(tokenizer)
        added = {i: text for text, i in added_token_ids(tokenizer).items()}
        # Every added token is special to llguidance, as its reading of HF tokenizers has it.
        self.special_token_ids = sorted({*getattr(tokenizer, "all_special_ids", []), *added})
        self.tokens = [
            added[i].encode() if i in added else _token_bytes(tokenizer, i) if i < known else b""
            for i in range(vocab_size)
        ]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def _token_bytes(tokenizer: Any, token_id: int) -> bytes:
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return b""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode()


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed masks, (..., ceil(V / 32)) int32, as (..., V) bool (True: allowed).

    Runs on whatever device ``bits`` is on (copy the small packed form, not the unpacked one).
    """
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1
    return unpacked.flatten(-2)[..., :vocab_size].bool()
