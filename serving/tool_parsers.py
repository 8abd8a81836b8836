"""Tool-call parsers: a model family's tool-call text read back as OpenAI's ``tool_calls``, and
the grammar that makes a model call (``tool_choice`` "required" or a named function).

Two formats, chosen by ``serve.tool_call_parser`` (``auto``: from the chat template's text):

* ``hermes`` (Hermes, Qwen 2.5 / 3, the demo pair): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, after optional text.
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is read too), several separated by
  ``;``, optionally after ``<|python_tag|>``.

A :class:`ToolCallScanner` reads a reply as it streams, one piece of text at a time, and says
what can go out: content text, or a whole tool call once its JSON is complete; the non-streamed
answer is the same scanner fed the whole text, so both agree. What does not parse as a call of
one of the offered tools (broken JSON, an unknown name, arguments that are not an object) stays
content, never a call the client cannot run. Text that may start a call is held back until it
is clear whether it does.

The grammars are Lark grammars for llguidance (:mod:`osd.decode.grammar`): the call's marker
text, then the function's name as a constant and its arguments following the tool's JSON schema
(``%json``), compact, as the demo corpus writes them. Arguments therefore always parse and
validate. The grammar masks the draft and the target alike, so speculation stays exact.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PARSERS",
    "ParsedCall",
    "ToolCallFormat",
    "ToolCallScanner",
    "detect_parser",
    "tool_call_format",
]

PARSERS = ("hermes", "llama3_json")
_COMPACT = {"whitespace_flexible": False}  # llguidance's JSON options, as x-guidance


@dataclass(frozen=True)
class ParsedCall:
    """One tool call read from a reply: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes tool calls.

    Attributes:
        name: the parser's name (``PARSERS``).
        start: the text that opens a call (hermes) or ``""``: the reply itself is the calls.
        end: the text that closes a call (hermes).
        arguments_key: the key the model writes the arguments under.
        separator: between two calls (in the grammar; the scanner accepts any whitespace).
    """

    name: str
    start: str
    end: str
    arguments_key: str
    separator: str

    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        """A Lark grammar whose outputs are one call (or, with ``parallel``, one or more) of
        ``functions`` (OpenAI's ``function`` objects: ``name`` and ``parameters``)."""
        if not functions:
            raise ValueError("a tool-call grammar needs at least one function")
        bodies = [f"fn_{i}" for i in range(len(functions))]
        rules = [
            "%llguidance {}",
            "start: call" + (f" ({json.dumps(self.separator)} call)*" if parallel else ""),
            f"call: {json.dumps(self.start)} body {json.dumps(self.end)}"
            if self.start
            else "call: body",
            "body: " + " | ".join(bodies),
        ]
        for rule, function in zip(bodies, functions, strict=True):
            rules.append(f"{rule}: %json {json.dumps(self._call_schema(function))}")
        return "\n".join(rules) + "\n"

    def _call_schema(self, function: Mapping[str, Any]) -> dict[str, Any]:
        """The schema of one call of ``function``: its name, and its parameters' schema under
        the arguments key. The parameters' definitions (``$defs``, ``definitions``) move to
        the call's root, where their references (``#/$defs/...``) point; a reference to
        another place of the parameters gets their new path. Parameters with an ``$id`` are
        a resource of their own, whose references resolve inside them: left as they are. No
        parameters: no arguments (``{}``), as OpenAI reads a function without them."""
        parameters = dict(function.get("parameters") or {"properties": {}})
        if not function.get("parameters"):
            parameters["additionalProperties"] = False
        parameters.setdefault("type", "object")
        own_resource = "$id" in parameters
        lifted = {
            key: parameters.pop(key)
            for key in _DEFINITIONS
            if key in parameters and not own_resource
        }
        root = f"#/properties/{self.arguments_key}"
        nested = parameters if own_resource else _rerooted(parameters, root)
        return {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, self.arguments_key: nested},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
            "x-guidance": _COMPACT,
            **{key: _rerooted(value, root) for key, value in lifted.items()},
        }


_DEFINITIONS = ("$defs", "definitions")
# Keywords whose values are data, not schemas: a "$ref" inside one is a value to match.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


class _Number:
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
_JSON = json.JSONDecoder(parse_float=_Number, parse_constant=_not_json)


def _dumps(value: Any) -> str:
    """``value`` (as :data:`_JSON` reads it) as JSON text, numbers as they were written."""
    if isinstance(value, _Number):
        return value.text
    if isinstance(value, dict):
        items = (f"{json.dumps(k, ensure_ascii=False)}: {_dumps(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_dumps(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _rerooted(schema: Any, root: str) -> Any:
    """``schema`` with every local ``$ref`` that points into the parameters (not at their
    definitions, which move to the call's root) prefixed by ``root``, their new place."""
    if isinstance(schema, list):
        return [_rerooted(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: value if key in _DATA_KEYWORDS else _rerooted(value, root)
        for key, value in schema.items()
    }
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return out
    # A JSON pointer may escape its characters (%24defs is $defs).
    if not urllib.parse.unquote(ref).startswith(tuple(f"#/{key}/" for key in _DEFINITIONS)):
        out["$ref"] = root + ref[1:]
    return out


_FORMATS = {
    "hermes": ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", "\n"),
    "llama3_json": ToolCallFormat("llama3_json", "", "", "parameters", "; "),
}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format of parser ``name``.

    Raises:
        ValueError: an unknown parser.
    """
    if name not in _FORMATS:
        raise ValueError(f"tool_call_parser must be one of {list(PARSERS)}, got {name!r}")
    return _FORMATS[name]


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's text asks for; None: it shows no known tool-call format."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


class ToolCallScanner:
    """Reads one reply as it streams; :meth:`feed` and :meth:`finish` say what can go out.

    Args:
        parser: ``hermes`` or ``llama3_json``.
        functions: the offered functions' names (a call of another name stays content).
        parallel: false keeps the first call only (OpenAI's ``parallel_tool_calls: false``).
    """

    def __init__(self, parser: str, functions: Sequence[str], parallel: bool = True) -> None:
        self._format = tool_call_format(parser)
        self._functions = frozenset(functions)
        self._parallel = parallel
        self._pending = ""  # text not yet given out
        self._in_call = False  # hermes: inside <tool_call> ... </tool_call>
        self._gap = ""  # hermes: the whitespace before the open call (its text if no call)
        self._mode: str | None = None  # llama3_json: "calls" or "text", once decided
        self.calls: list[ParsedCall] = []

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Takes the next piece of the reply; returns (content to send, calls completed)."""
        self._pending += text
        if self._format.name == "hermes":
            return self._hermes(final=False)
        return self._llama(final=False)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The reply ended: everything held back goes out (an unfinished call as content)."""
        if self._format.name == "hermes":
            return self._hermes(final=True)
        return self._llama(final=True)

    def _accept(self, call: ParsedCall | None) -> list[ParsedCall]:
        if call is None or (self.calls and not self._parallel):
            return []
        self.calls.append(call)
        return [call]

    def _read_call(self, text: str, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
        try:
            value = _JSON.decode(text)
        except ValueError:
            return None
        return self._call_of(value, arguments_keys)

    def _call_of(self, value: Any, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
        if not isinstance(value, dict) or value.get("name") not in self._functions:
            return None
        key = next((k for k in arguments_keys if k in value), None)
        arguments = {} if key is None else value[key]
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = _JSON.decode(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        text = _dumps(arguments)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\\ud800"): the UTF-8 answer cannot hold it
            return None
        return ParsedCall(value["name"], text)

    def _hermes(self, final: bool) -> tuple[str, list[ParsedCall]]:
        content, calls = "", list[ParsedCall]()
        while True:
            if self._in_call:
                end = self._pending.find(_HERMES_CLOSE)
                if end < 0:
                    if final:  # an unfinished call: the client gets its text
                        content += self._gap + _HERMES_OPEN + self._pending
                        self._pending, self._in_call = "", False
                    return content, calls
                body = self._pending[:end]
                self._pending = self._pending[end + len(_HERMES_CLOSE) :]
                self._in_call = False
                parsed = self._read_call(body.strip(), ("arguments", "parameters"))
                if parsed is None:
                    content += self._gap + _HERMES_OPEN + body + _HERMES_CLOSE
                else:
                    calls += self._accept(parsed)
                continue
            start = self._pending.find(_HERMES_OPEN)
            if start >= 0:
                # Whitespace between content and a call (or between calls) is the format's.
                before = self._pending[:start]
                content += before.rstrip()
                self._gap = before[len(before.rstrip()) :]
                self._pending = self._pending[start + len(_HERMES_OPEN) :]
                self._in_call = True
                continue
            if final:
                rest = self._pending if not self.calls else self._pending.strip()
                content, self._pending = content + rest, ""
                return content, calls
            keep = _held_back(self._pending, _HERMES_OPEN)
            out = self._pending[: len(self._pending) - keep]
            # Trailing whitespace waits: it is dropped if a call follows.
            stripped = out.rstrip()
            if self.calls and not stripped:
                return content, calls
            content += stripped
            self._pending = self._pending[len(stripped) :]
            return content, calls

    def _llama(self, final: bool) -> tuple[str, list[ParsedCall]]:
        if self._mode is None:
            head = self._pending.lstrip()
            if head.startswith(("{", _PYTHON_TAG)):
                self._mode = "calls"
            elif head and not _PYTHON_TAG.startswith(head):
                self._mode = "text"
            elif not final:
                return "", []
            else:
                self._mode = "text"
        if self._mode == "text":
            content, self._pending = self._pending, ""
            return content, []
        if not final:  # the calls are read when the reply is complete
            return "", []
        text = self._pending.strip()
        self._pending = ""
        parsed = self._llama_calls(text.removeprefix(_PYTHON_TAG).strip())
        if parsed is None:
            return text, []
        return "", [call for p in parsed for call in self._accept(p)]

    def _llama_calls(self, text: str) -> list[ParsedCall] | None:
        decoder, calls, at = _JSON, list[ParsedCall](), 0
        while at < len(text):
            try:
                value, at = decoder.raw_decode(text, at)
            except ValueError:  # not JSON, or NaN / Infinity
                return None
            call = self._call_of(value, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = re.match(r"\s*;?\s*", text[at:])
            at += rest.end() if rest else 0
        return calls or None


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
