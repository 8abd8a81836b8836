"""A tool call's argument values as the model wrote them: JSON read with numbers kept as
written, and Gemma 4's own notation of arguments (``key:<|"|>text<|"|>,n:3``), read into the same
values. Pure: no tokenizer, no I/O."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

__all__ = ["GEMMA_QUOTE", "JSON", "JSON_NUMBER", "Number", "dumps", "gemma_arguments"]


class Number:
    """A JSON number with a fraction or exponent, as the model wrote it: a float would make
    ``3e9999`` ``Infinity`` (not JSON: strict parsers refuse the call) and round long
    decimals. (Integers are exact as ints.)"""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Calls are read with numbers kept as written, and NaN / Infinity refused (Python's json takes
# them; a call that holds one stays text).
JSON = json.JSONDecoder(parse_float=Number, parse_constant=_not_json)
JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def dumps(value: Any) -> str:
    """``value`` (as :data:`JSON` reads it) as JSON text, numbers as they were written."""
    if isinstance(value, Number):
        return value.text
    if isinstance(value, dict):
        items = (f"{json.dumps(k, ensure_ascii=False)}: {dumps(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)


# Gemma 4 quotes strings (and a mapping's keys, in declarations) between this token's text.
GEMMA_QUOTE = '<|"|>'
# A bare value's words (Jinja writes Python's None and booleans as words too).
_WORDS = {"true": True, "false": False, "null": None, "None": None, "True": True, "False": False}
_DEPTH = 64  # nesting a reply's arguments may have (deeper: not read as a call)


def gemma_arguments(text: str) -> dict[str, Any] | None:
    """The arguments Gemma 4 writes inside ``call:name{...}``: ``key:value`` pairs apart by
    commas, a string between ``<|"|>`` (or in JSON's quotes), a mapping in braces, a list in
    brackets, other values bare: ``true``, ``false``, ``null`` (Jinja's ``None`` too), a
    number (kept as written), else the word as a string (as vLLM reads it). None: text that
    is not such pairs (unbalanced, unterminated, a key without a value)."""
    reader = _GemmaReader(text)
    try:
        arguments = reader.pairs(end="")
    except (ValueError, RecursionError):
        return None
    return arguments


class _GemmaReader:
    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def _space(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\r\n":
            self.at += 1

    def _peek(self, what: str) -> bool:
        return self.text.startswith(what, self.at)

    def pairs(self, end: str, depth: int = 0) -> dict[str, Any]:
        """``key:value, ...`` up to ``end`` (``""``: the text's end), which it passes."""
        return dict(self._listed(end, lambda: self._pair(depth), depth))

    def _pair(self, depth: int) -> tuple[str, Any]:
        key = self._key()
        self._space()
        self._expect(":")
        self._space()
        return key, self._value(depth)

    def _listed(self, end: str, item: Callable[[], Any], depth: int) -> list[Any]:
        """Items read by ``item``, apart by commas, up to ``end``, which it passes."""
        if depth > _DEPTH:
            raise ValueError("nested too deep")
        items: list[Any] = []
        self._space()
        while not self._closes(end):
            if items:
                self._expect(",")
                self._space()
            items.append(item())
            self._space()
        self.at += len(end)
        return items

    def _closes(self, end: str) -> bool:
        if not end:
            return self.at >= len(self.text)
        if self.at >= len(self.text):
            raise ValueError(f"no closing {end}")
        return self._peek(end)

    def _expect(self, what: str) -> None:
        if not self._peek(what):
            raise ValueError(f"expected {what!r} at {self.at}")
        self.at += len(what)

    def _key(self) -> str:
        if self._peek(GEMMA_QUOTE) or self._peek('"'):
            key = self._value(0)
            if not isinstance(key, str):
                raise ValueError("a key is text")
            return key
        return self._word(":,{}[]")

    def _value(self, depth: int) -> Any:
        if self._peek(GEMMA_QUOTE):
            start = self.at + len(GEMMA_QUOTE)
            end = self.text.find(GEMMA_QUOTE, start)
            if end < 0:
                raise ValueError("unterminated string")
            self.at = end + len(GEMMA_QUOTE)
            return self.text[start:end]
        if self._peek('"'):
            value, self.at = JSON.raw_decode(self.text, self.at)
            return value
        if self._peek("{"):
            self.at += 1
            return self.pairs("}", depth + 1)
        if self._peek("["):
            self.at += 1
            return self._listed("]", lambda: self._value(depth + 1), depth + 1)
        word = self._word(",}]")
        if word in _WORDS:
            return _WORDS[word]
        if JSON_NUMBER.fullmatch(word):
            return JSON.decode(word)
        return word

    def _word(self, ends: str) -> str:
        """Bare text up to one of ``ends`` (or the text's end), without its spaces."""
        start = self.at
        while self.at < len(self.text) and self.text[self.at] not in ends:
            self.at += 1
        word = self.text[start : self.at].strip()
        if not word:
            raise ValueError(f"nothing at {start}")
        return word
