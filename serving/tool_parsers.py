"""Tool-call parsers: a model family's tool-call text read back as OpenAI's ``tool_calls``, and
the grammar that makes a model call (``tool_choice`` "required" or a named function).

Eleven formats, chosen by ``serve.tool_call_parser`` (``auto``: from the chat template's text):

* ``hermes`` (Hermes, Qwen 2.5 / 3, the demo pair): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, after optional text.
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is read too), several separated by
  ``;``, optionally after ``<|python_tag|>`` (or between Llama 4's ``<|python_start|>`` and
  ``<|python_end|>``).
* ``mistral``: text, then ``[TOOL_CALLS]`` and the calls: before v11 (Mistral 7B v0.3,
  Mixtral, Nemo) a JSON list ``[{"name": ..., "arguments": {...}}, ...]``; from v11 (Small 3.2,
  Magistral, Devstral) ``[TOOL_CALLS]name[ARGS]{...}`` for each call. Both are read; the
  grammar writes the one the chat template shows. Mistral's templates take 9-character
  alphanumeric call ids only: the calls get such ids, and a history's other ids are mapped.
  ``[TOOL_CALLS]`` is a special token of Mistral's tokenizers: requests with tools keep special
  tokens in their text (``skip_special_tokens`` off, as vLLM's mistral parser asks).
* ``qwen3_coder`` (Qwen3-Coder, and the Qwen models whose templates write calls as XML): each
  call is ``<tool_call>\n<function=name>\n`` then ``<parameter=key>\nvalue\n</parameter>\n``
  for each argument, then ``</function>\n</tool_call>``. A value is text; it is read as the
  parameter's schema types it (an integer, a number, a boolean, JSON for an object or array,
  ``null``), and stays a string where it does not parse so (vLLM's ``qwen3_coder`` reads it so).
* ``openai`` (gpt-oss, vLLM's name): harmony's ``commentary`` message to ``functions.name``,
  read with the reply's thinking by :mod:`serving.harmony`; this module writes its grammar.
* ``deepseek_v3`` (DeepSeek V3, R1-0528) and ``deepseek_v31`` (V3.1 and its successors that
  keep its format): ``<｜tool▁calls▁begin｜>``, then each call as ``<｜tool▁call▁begin｜>``
  ``function<｜tool▁sep｜>name`` and its arguments in a ```` ```json ```` fence (V3), or
  ``name<｜tool▁sep｜>{...}`` (V3.1), then ``<｜tool▁call▁end｜>``; ``<｜tool▁calls▁end｜>`` closes.
  Their templates write an earlier call's arguments as the text they are given: the history's
  arguments go to them as JSON text.
* ``glm45`` (GLM-4.5, 4.6; ``glm47``, its other name, for GLM-4.7): ``<tool_call>name``, then
  ``<arg_key>key</arg_key><arg_value>value</arg_value>`` for each argument, then
  ``</tool_call>``; GLM-4.5's templates write a newline after the name and after each key and
  value, GLM-4.7's none (the grammar writes what the model's template shows). A string's
  value is written as it is, any other as ``tojson`` writes it: read as the schema types it.
* ``pythonic`` (``llama4_pythonic``, its other name): the whole reply is a Python list of
  calls with keyword arguments, ``[name(key=value, ...), ...]`` (Llama 4's between
  ``<|python_start|>`` and ``<|python_end|>`` too), read when complete; values are Python
  literals (JSON's ``true``, ``false``, ``null`` read too, numbers kept as written).
* ``kimi_k2`` (Kimi K2): ``<|tool_calls_section_begin|>``, then each call as
  ``<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>``,
  then ``<|tool_calls_section_end|>``. The header (``functions.name:0``) is the call's id, as
  Kimi's template writes ids back and vLLM's parser answers them.

* ``gemma4`` (Gemma 4): each call is ``<|tool_call>call:name{key:value,...}<tool_call|>``, in
  Gemma's own notation (:func:`serving.call_values.gemma_arguments`): bare keys, strings
  between ``<|"|>``, other values bare; the template sorts the keys. After its calls the
  model writes ``<|tool_response>``, where the reply ends.

A :class:`ToolCallScanner` reads a reply as it streams, one piece of text at a time, and says
what can go out: content text, or a whole tool call once its JSON is complete; the non-streamed
answer is the same scanner fed the whole text, so both agree. What does not parse as a call of
one of the offered tools (broken JSON, an unknown name, arguments that are not an object) stays
content, never a call the client cannot run. Text that may start a call is held back until it
is clear whether it does.

The grammars are Lark grammars for llguidance (:mod:`osd.decode.grammar`): the call's marker
(text, or the special token by its id, ``<[5]>``: text cannot spell a special token), then
the function's name as a constant and its arguments following the tool's JSON schema
(``%json``), spaced as the chat template writes an earlier call (compact for the demo pair);
for ``qwen3_coder`` each parameter in the schema's order, a string's value free text up to its
``\n</parameter>`` (bounded by ``maxLength``), any other value JSON of its schema.
Arguments therefore always parse and validate. The grammar masks the draft and the target
alike, so speculation stays exact.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import keyword
import math
import re
import secrets
import string
import urllib.parse
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from osd.config import TOOL_CALL_PARSERS
from osd.decode.models import added_token_ids, special_token_ids
from serving.call_values import GEMMA_QUOTE, JSON_NUMBER, gemma_arguments
from serving.call_values import JSON as _JSON
from serving.call_values import Number as _Number
from serving.call_values import dumps as _dumps

__all__ = [
    "PARSERS",
    "ParsedCall",
    "ToolCallFormat",
    "ToolCallScanner",
    "call_of_arguments",
    "detect_parser",
    "held_back",
    "speaks_harmony",
    "tool_call_format",
]

PARSERS = TOOL_CALL_PARSERS
# llguidance's JSON options (as x-guidance): compact, or spaced as Python's json.dumps and
# Jinja's tojson write it (", " and ": ", what Mistral's templates show the model).
_COMPACT = {"whitespace_flexible": False}
_SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ParsedCall:
    """One tool call read from a reply: the function's name and its arguments as JSON text;
    ``call_id``: the id the model wrote for it (Kimi K2's ``functions.name:0``), else None."""

    name: str
    arguments: str
    call_id: str | None = None


@dataclass(frozen=True)
class XmlMarkup:
    """How a family writes a call's name and parameters as XML-like text (Qwen3-Coder's,
    GLM's), for the grammar: the call's body is ``opening`` (``{name}`` the function's), then
    for each parameter ``key`` (``{key}`` its name), its value, ``value_end`` and ``item_end``,
    then ``closing``."""

    opening: str
    key: str
    value_end: str
    item_end: str
    closing: str


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes tool calls.

    The calls are ``opening``, then each call as ``start`` + body + ``end`` with ``separator``
    between two, then ``closing``. A body is the call's JSON object (``name`` and the
    arguments under ``arguments_key``) or, with ``arguments_marker``, the function's name as
    text, the marker and the arguments' JSON object (Mistral's v11 format).

    Attributes:
        name: the parser's name (``PARSERS``).
        start: the text that opens each call (hermes) or ``""``.
        end: the text that closes each call (hermes) or ``""``.
        arguments_key: the key the model writes the arguments under.
        separator: between two calls (in the grammar; the scanners accept any whitespace).
        opening: pieces of text before the first call (Mistral's ``[TOOL_CALLS] [``).
        closing: pieces of text after the last call.
        arguments_marker: between a call's name and its arguments; None: JSON calls.
        marker_ids: the tokenizer's added tokens in the pieces, with their ids: the grammar
            names each token (llguidance lets no text spell an added token).
        special_text: one of them is a special token: replies keep special tokens in their
            text, where the scanner reads it.
        short_ids: the chat template takes 9-character alphanumeric call ids (Mistral's).
        spaced: the grammar writes JSON with ``", "`` and ``": "`` (else compact).
        markers: the format's other pieces that may be special tokens (harmony's).
        name_prefix: pieces before a call's name (DeepSeek V3's ``function<｜tool▁sep｜>``,
            Kimi K2's ``functions.``).
        call_index: the name is followed by ``:N``, the call's number (Kimi K2's call ids).
        arguments_end: after a call's arguments (DeepSeek V3's closing code fence).
        arguments_text: the chat template writes an earlier call's arguments as given, as
            text (DeepSeek's: ``+ arguments``): the history's arguments go to it as JSON text.
        xml: the call's body is XML-like parameters (``qwen3_coder``, ``glm45``), not JSON.
    """

    name: str
    start: str
    end: str
    arguments_key: str
    separator: str
    opening: tuple[str, ...] = ()
    closing: tuple[str, ...] = ()
    arguments_marker: str | None = None
    marker_ids: tuple[tuple[str, int], ...] = ()
    special_text: bool = False
    short_ids: bool = False
    spaced: bool = False
    markers: tuple[str, ...] = ()
    name_prefix: tuple[str, ...] = ()
    call_index: bool = False
    arguments_end: str = ""
    arguments_text: bool = False
    xml: XmlMarkup | None = None

    @property
    def pieces(self) -> tuple[str, ...]:
        """The format's own text around the calls (any of it may be a special token)."""
        pieces = (*self.opening, self.start, self.end, self.separator, *self.closing)
        around = (*self.name_prefix, self.arguments_marker or "", self.arguments_end)
        xml = dataclasses.astuple(self.xml) if self.xml is not None else ()
        return tuple(p for p in (*pieces, *around, *xml, *self.markers) if p)

    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        """A Lark grammar whose outputs are one call (or, with ``parallel``, one or more) of
        ``functions`` (OpenAI's ``function`` objects: ``name`` and ``parameters``)."""
        if not functions:
            raise ValueError("a tool-call grammar needs at least one function")
        if self.name == "openai":  # one call: gpt-oss's turn ends at its <|call|>
            parallel = False
        bodies = [f"fn_{i}" for i in range(len(functions))]
        between = f"{self._text(self.separator)} " if self.separator else ""
        more = f" ({between}call)*" if parallel else ""
        closing = self._sequence("", *self.closing)
        rules = [
            "%llguidance {}",
            f"{self._sequence('start:', *self.opening)} call{more}{closing}",
            f"{self._sequence('call:', self.start)} body{self._sequence('', self.end)}",
            "body: " + " | ".join(bodies),
        ]
        for rule, function in zip(bodies, functions, strict=True):
            if self.xml is not None:
                rules += _xml_call_rules(rule, function, self._json_options, self.xml, self._text)
            elif self.name in _PYTHONIC_NAMES:
                rules += _python_call_rules(rule, function, self._json_options)
            elif self.name == "gemma4":
                rules += _gemma_call_rules(rule, function, self._text(GEMMA_QUOTE))
            elif self.name == "openai":
                schema = {**_parameters(function), "x-guidance": self._json_options}
                header = self._sequence(
                    "", f"commentary to=functions.{function['name']} ", *_HARMONY_HEADER_END
                )
                rules.append(f"{rule}:{header} %json {json.dumps(schema)}")
            elif self.arguments_marker is None:
                rules.append(f"{rule}: %json {json.dumps(self._call_schema(function))}")
            else:
                schema = {**_parameters(function), "x-guidance": self._json_options}
                name = self._sequence("", *self.name_prefix, function["name"])
                index = ' ":" /[0-9]{1,3}/' if self.call_index else ""
                marker = self._sequence("", self.arguments_marker)
                end = self._sequence("", self.arguments_end)
                rules.append(f"{rule}:{name}{index}{marker} %json {json.dumps(schema)}{end}")
        return "\n".join(rules) + "\n"

    @property
    def _json_options(self) -> dict[str, Any]:
        return _SPACED if self.spaced else _COMPACT

    def _text(self, piece: str) -> str:
        """``piece`` in the grammar: its text, each added token in it by its id
        (``"<tool_call>\n"``: ``<[151657]> "\n"``)."""
        if not self.marker_ids:
            return json.dumps(piece) if piece else ""
        ids = dict(self.marker_ids)
        tokens = re.compile("|".join(re.escape(m) for m in sorted(ids, key=len, reverse=True)))
        parts, at = [], 0
        for found in tokens.finditer(piece):
            if found.start() > at:
                parts.append(json.dumps(piece[at : found.start()]))
            parts.append(f"<[{ids[found.group()]}]>")
            at = found.end()
        if at < len(piece):
            parts.append(json.dumps(piece[at:]))
        return " ".join(parts)

    def _sequence(self, head: str, *pieces: str) -> str:
        return head + "".join(f" {self._text(p)}" for p in pieces if p)

    def _call_schema(self, function: Mapping[str, Any]) -> dict[str, Any]:
        """The schema of one call of ``function``: its name, and its parameters' schema under
        the arguments key. The parameters' definitions (``$defs``, ``definitions``) move to
        the call's root, where their references (``#/$defs/...``) point; a reference to
        another place of the parameters gets their new path. Parameters with an ``$id`` are
        a resource of their own, whose references resolve inside them: left as they are."""
        parameters = _parameters(function)
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
            "x-guidance": self._json_options,
            **{key: _rerooted(value, root) for key, value in lifted.items()},
        }

    def new_call_id(self) -> str:
        """A new call's id: OpenAI's shape, or 9 letters and digits where the template
        takes no other (Mistral's, as vLLM's mistral parser makes them)."""
        if self.short_ids:
            return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` as this format's chat template takes them: with ``short_ids``, every
        call id of the history (an assistant's ``tool_calls[].id``, a tool's
        ``tool_call_id``) that is not 9 letters and digits becomes 9 that are, the same
        id always the same (a client may send OpenAI's ids, or another server's); with
        ``arguments_text``, an earlier call's arguments object is JSON text again, spaced as
        the format writes it."""
        if not (self.short_ids or self.arguments_text):
            return messages
        for message in messages:
            for call in message.get("tool_calls") or []:
                if self.short_ids and isinstance(call.get("id"), str):
                    call["id"] = _short_id(call["id"])
                function = call.get("function")
                if self.arguments_text and isinstance(function, dict):
                    arguments = function.get("arguments")
                    if not isinstance(arguments, str):
                        function["arguments"] = json.dumps(
                            arguments,
                            ensure_ascii=False,
                            separators=(", ", ": ") if self.spaced else (",", ":"),
                        )
            if self.short_ids and isinstance(message.get("tool_call_id"), str):
                message["tool_call_id"] = _short_id(message["tool_call_id"])
        return messages


_ALPHANUMERIC = string.ascii_letters + string.digits


def _short_id(call_id: str) -> str:
    """``call_id`` if it is 9 letters and digits, else 9 of them derived from it."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    digits = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHANUMERIC))
        digits.append(_ALPHANUMERIC[digit])
    return "".join(digits)


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameters' schema, of an object. No parameters: no arguments (``{}``),
    as OpenAI reads a function without them."""
    parameters = dict(function.get("parameters") or {"properties": {}})
    if not function.get("parameters"):
        parameters["additionalProperties"] = False
    parameters.setdefault("type", "object")
    return parameters


_DEFINITIONS = ("$defs", "definitions")
# Keywords whose values are data, not schemas: a "$ref" inside one is a value to match.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


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


def _xml_call_rules(
    rule: str,
    function: Mapping[str, Any],
    json_options: Mapping[str, Any],
    markup: XmlMarkup,
    text: Callable[[str], str],
) -> list[str]:
    """The grammar's rules for one call of ``function`` written as ``markup`` (the
    ``<tool_call>`` around it is the format's): its name, each parameter of the schema in its
    order (the required ones always, the others optional), the closing. A string's value is
    text up to the value's end (its ``enum`` or ``const`` where it has one; a ``maxLength``
    bounds it), any other value JSON of its schema, spaced as ``tojson`` writes it. ``text``
    writes a piece of markup (an added token in it by its id)."""
    parameters = _parameters(function)
    definitions = {key: parameters[key] for key in _DEFINITIONS if key in parameters}
    required = set(parameters.get("required") or ())
    rules, items = [], []
    properties = parameters.get("properties") or {}
    tail = f" {text(markup.item_end)}" if markup.item_end else ""
    for number, (name, schema) in enumerate(properties.items()):
        value = f"{rule}_{number}"
        head = text(markup.key.format(key=name))
        rules.append(_xml_value_rule(value, schema, definitions, json_options, markup, text))
        items.append(f"({head} {value}{tail})" + ("" if name in required else "?"))
    opening = text(markup.opening.format(name=function["name"]))
    closing = f" {text(markup.closing)}" if markup.closing else ""
    rules.insert(0, f"{rule}: {opening} {' '.join(items)}{closing}")
    return rules


def _xml_value_rule(
    rule: str,
    schema: Any,
    definitions: Mapping[str, Any],
    json_options: Mapping[str, Any],
    markup: XmlMarkup,
    text: Callable[[str], str],
) -> str:
    """One parameter's value and the end that closes it."""
    end = text(markup.value_end)
    if not isinstance(schema, dict):  # true / false schemas: any text
        schema = {}
    words = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if words and all(isinstance(word, str) for word in words):
        return f"{rule}: ({' | '.join(json.dumps(word) for word in words)}) {end}"
    if _xml_string(schema):
        longest = schema.get("maxLength")
        bounded = isinstance(longest, int) and longest >= 0
        if "<[" in end:  # the end is a token: text (which cannot spell it), then the token
            span = f"{{0,{longest}}}" if bounded else "*"
            return f"{rule}: /(?s:.{span})/ {end}"
        if bounded:
            # One lexeme with its end: llguidance's lexer is greedy (a bounded value, then the
            # end as a lexeme of its own, would take "\n<" into the value), and its stop
            # takes no bounded text.
            return f"{rule}: /(?s:.{{0,{longest}}}){_regex_text(markup.value_end)}/"
        return f"{rule}[stop={end}]: /(?s:.*)/"
    if schema.get("type") == "boolean":  # Qwen3-Coder's template writes Python's True, False
        return f'{rule}: ("true" | "false" | "True" | "False") {end}'
    typed = {**definitions, **schema, "x-guidance": dict(json_options)}
    return f"{rule}: %json {json.dumps(typed)} {end}"


def _regex_text(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    special = set(".+*?()|[]{}^$#&-~\\/")
    return "".join("\\n" if c == "\n" else f"\\{c}" if c in special else c for c in text)


def _python_call_rules(
    rule: str, function: Mapping[str, Any], json_options: Mapping[str, Any]
) -> list[str]:
    """The grammar's rules for one pythonic call of ``function``: ``name(key=value, ...)``,
    its keyword arguments in the schema's order (the required ones always, the others
    optional), each value a Python literal of its schema: a string enum's words quoted,
    ``True`` / ``False`` for a boolean, ``None`` for null, else JSON of its schema (a JSON
    string, number, list or object is a Python literal too; ``true`` inside one is read as
    Python's ``True``).

    Raises:
        ValueError: a function or parameter name that Python cannot write there (``get-x``,
            ``from``): the call would not read back.
    """
    parameters = _parameters(function)
    properties = parameters.get("properties") or {}
    for name in (function["name"], *properties):
        if not str(name).isidentifier() or keyword.iskeyword(name):
            raise ValueError(
                f"pythonic tool calls write names as Python does; {name!r} is not a Python "
                "identifier, so a forced call of it could not be read back"
            )
    definitions = {key: parameters[key] for key in _DEFINITIONS if key in parameters}
    required = set(parameters.get("required") or ())
    rules, items = [], []
    for number, (name, schema) in enumerate(properties.items()):
        value = f"{rule}_{number}"
        rules.append(f"{value}: {_python_value_rule(schema, definitions, json_options)}")
        items.append((f"{json.dumps(name + '=')} {value}", name in required))
    arguments = _listed(rule, items, rules)
    rules.insert(0, f'{rule}: {json.dumps(function["name"] + "(")} {arguments} ")"')
    return rules


def _python_value_rule(
    schema: Any, definitions: Mapping[str, Any], json_options: Mapping[str, Any]
) -> str:
    if not isinstance(schema, dict):  # true / false schemas: any JSON
        schema = {}
    words = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if words and all(isinstance(word, str) for word in words):
        quoted = (json.dumps(json.dumps(word, ensure_ascii=False)) for word in words)
        return "(" + " | ".join(quoted) + ")"
    kind = schema.get("type")
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    typed = {**definitions, **schema, "x-guidance": dict(json_options)}
    return f"%json {json.dumps(typed)}"


def _gemma_call_rules(rule: str, function: Mapping[str, Any], quote: str) -> list[str]:
    """The grammar's rules for one Gemma 4 call of ``function``: ``call:name{key:value,...}``,
    its arguments in the order of their keys (Gemma's template sorts them), each value in
    Gemma's notation (:func:`_gemma_value_rule`); ``quote``: ``<|"|>`` in the grammar."""
    rules: list[str] = []
    arguments = _gemma_object(rule, _parameters(function), quote, rules, {})
    rules.insert(0, f"{rule}: {json.dumps('call:' + function['name'])} {arguments}")
    return rules


def _gemma_object(
    rule: str,
    schema: Mapping[str, Any],
    quote: str,
    rules: list[str],
    definitions: Mapping[str, Any],
) -> str:
    """``{key:value,...}`` of an object's ``properties`` (sorted by key; the required ones
    always, the others optional), each value's rules added to ``rules``."""
    definitions = {**definitions, **{k: schema[k] for k in _DEFINITIONS if k in schema}}
    required = set(schema.get("required") or ())
    items = []
    properties = schema.get("properties") or {}
    # (Jinja's dictsort, which Gemma's template uses, ignores case)
    for number, name in enumerate(sorted(properties, key=str.lower)):
        value = f"{rule}_{number}"
        rules.append(
            f"{value}: {_gemma_value_rule(value, properties[name], quote, rules, definitions)}"
        )
        key = json.dumps(name + ":")
        if not name or not _GEMMA_BARE_KEY.fullmatch(name):  # (read back only when quoted)
            key = f'{quote} {json.dumps(name)} {quote} ":"'
        items.append((f"{key} {value}", name in required))
    listed = _listed(rule, items, rules, separator=",") if items else ""
    return f'"{{" {listed} "}}"'


def _gemma_value_rule(
    rule: str,
    schema: Any,
    quote: str,
    rules: list[str],
    definitions: Mapping[str, Any],
) -> str:
    """One value in Gemma's notation: a string between ``<|"|>`` (a string enum's words), a
    boolean or null as a word, a number as JSON writes it, an object of ``properties`` in
    braces, a list of ``items`` in brackets. A schema Gemma's notation cannot hold exactly
    (a pattern, a combination, a reference, bounded lists) is JSON of the schema, which the
    reader takes too (JSON's strings and keys in quotes)."""
    if not isinstance(schema, dict):  # true / false schemas: any JSON
        schema = {}
    words = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if words and all(isinstance(word, str) for word in words):
        return "(" + " | ".join(f"{quote} {json.dumps(word)} {quote}" for word in words) + ")"
    kind = schema.get("type")
    plain = not any(key in schema for key in ("anyOf", "oneOf", "allOf", "$ref", "not"))
    if plain and kind == "string" and not any(k in schema for k in ("pattern", "format")):
        least, most = schema.get("minLength", 0), schema.get("maxLength")
        bounded = isinstance(most, int) and most >= 0
        if isinstance(least, int) and least <= (most if bounded else least):
            span = f"{{{least},{most}}}" if bounded else f"{{{least},}}"
            if quote.startswith("<["):  # the quote is a token: text cannot spell it
                return f"{quote} /(?s:.{span})/ {quote}"
            if bounded:  # one lexeme with its end (as _xml_value_rule's, for the same reason)
                return f"{quote} /(?s:.{span}){_regex_text(GEMMA_QUOTE)}/"
            if not least:
                rules.append(f"{rule}_text[stop={json.dumps(GEMMA_QUOTE)}]: /(?s:.*)/")
                return f"{quote} {rule}_text"
    if plain and kind == "boolean":
        return '("true" | "false")'
    if plain and kind == "null":
        return '"null"'
    if plain and kind == "object" and "properties" in schema:
        return _gemma_object(rule, schema, quote, rules, definitions)
    items = schema.get("items")
    bounds = ("minItems", "maxItems", "uniqueItems", "prefixItems", "contains")
    listed = isinstance(items, dict) and not any(bound in schema for bound in bounds)
    if plain and kind == "array" and listed:
        item = f"{rule}_item"
        rules.append(f"{item}: {_gemma_value_rule(item, items, quote, rules, definitions)}")
        return f'"[" ({item} ("," {item})*)? "]"'
    typed = {**definitions, **schema, "x-guidance": dict(_COMPACT)}
    return f"%json {json.dumps(typed)}"


def _listed(
    rule: str, items: list[tuple[str, bool]], rules: list[str], separator: str = ", "
) -> str:
    """A Lark expression of ``items`` (each an expression and whether it must be there) in
    their order, ``separator`` between two that are there; its rules (two a item, none
    nested) go to ``rules``."""
    count = len(items)
    between = json.dumps(separator)

    def rest(k: int) -> str:  # items k on, after one that is there
        return f" {rule}_rest{k}" if k < count else ""

    def first(k: int) -> str:  # items k on, none there before
        return f"{rule}_first{k}" if k < count else ""

    for k, (item, needed) in enumerate(items):
        rules.append(
            f"{rule}_rest{k}: "
            + (f"{between} {item}" if needed else f"({between} {item})?")
            + rest(k + 1)
        )
        head = f"{item}{rest(k + 1)}"
        if needed:
            rules.append(f"{rule}_first{k}: {head}")
        elif k + 1 < count:
            rules.append(f"{rule}_first{k}: {head} | {first(k + 1)}")
        else:
            rules.append(f"{rule}_first{k}: ({head})?")
    return first(0)


def _xml_string(schema: Mapping[str, Any]) -> bool:
    """Whether a parameter's value is written as text (a string, or a schema without a type:
    the template writes strings as they are)."""
    types = schema.get("type")
    if types is None:
        return not any(key in schema for key in ("anyOf", "oneOf", "allOf", "$ref", "enum"))
    return "string" in (types if isinstance(types, list) else [types])


_MISTRAL = "[TOOL_CALLS]"
_PYTHONIC = ToolCallFormat("pythonic", "", "", "arguments", ", ", ("[",), ("]",), spaced=True)
_PYTHONIC_NAMES = ("pythonic", "llama4_pythonic")
# GLM's: strings as they are, other values as tojson writes them.
_GLM_KEY = "<arg_key>{key}</arg_key>{between}<arg_value>"
_GLM = ToolCallFormat(
    "glm45",
    "<tool_call>",
    "</tool_call>",
    "arguments",
    "\n",
    spaced=True,
    xml=XmlMarkup("{name}\n", _GLM_KEY.format(key="{key}", between="\n"), "</arg_value>", "\n", ""),
)
# DeepSeek V3 / R1 and V3.1's markers (added tokens of their tokenizers).
_DS_CALLS, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DEEPSEEK = ToolCallFormat(
    "deepseek_v31",
    _DS_CALL,
    _DS_CALL_END,
    "arguments",
    "",
    (_DS_CALLS,),
    (_DS_CALLS_END,),
    arguments_marker=_DS_SEP,
    spaced=True,
    arguments_text=True,
)
# Kimi K2's (special tokens of its tokenizer).
_KIMI_SECTION, _KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI_CALL, _KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
_KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
# harmony: a call's message is <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
_HARMONY_HEADER_END = ("<|constrain|>", "json", "<|message|>")
_HERMES = ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", "\n")
# Gemma 4's (special tokens of its tokenizer); after its calls the model writes
# <|tool_response>, where its template has the tools' answers follow.
_GEMMA_CALL, _GEMMA_CALL_END = "<|tool_call>", "<tool_call|>"
GEMMA_TOOL_RESPONSE = "<|tool_response>"
_FORMATS = {
    "hermes": _HERMES,
    "llama3_json": ToolCallFormat("llama3_json", "", "", "parameters", "; "),
    # Mistral 7B v0.3 and Mixtral 8x22B write "[TOOL_CALLS] ["; the Tekken ones (Nemo, Small 3
    # and 3.1, Large 2411) "[TOOL_CALLS][" (tool_call_format picks by the template).
    "mistral": ToolCallFormat(
        "mistral", "", "", "arguments", ", ", (_MISTRAL, " ["), ("]",), short_ids=True, spaced=True
    ),
    # Qwen3-Coder: hermes's <tool_call> around XML; objects and arrays as tojson writes them.
    "qwen3_coder": dataclasses.replace(
        _HERMES,
        name="qwen3_coder",
        spaced=True,
        xml=XmlMarkup(
            "<function={name}>\n", "<parameter={key}>\n", "\n</parameter>", "\n", "</function>"
        ),
    ),
    # GLM-4.5 / 4.6: <tool_call>name, then <arg_key>k</arg_key> <arg_value>v</arg_value> for each
    # argument, a newline after each; GLM-4.7 without them (tool_call_format reads which).
    "glm45": _GLM,
    "glm47": dataclasses.replace(
        _GLM,
        name="glm47",
        xml=XmlMarkup("{name}", _GLM_KEY.format(key="{key}", between=""), "</arg_value>", "", ""),
    ),
    # Pythonic (Llama 3.2 and 4 with such templates, ToolACE): [name(key=value, ...), ...]
    "pythonic": _PYTHONIC,
    "llama4_pythonic": dataclasses.replace(_PYTHONIC, name="llama4_pythonic"),
    "openai": ToolCallFormat(
        "openai",
        "<|channel|>",
        "",
        "arguments",
        "",
        markers=("<|constrain|>", "<|message|>"),
    ),
    # DeepSeek V3.1 (and V3.1-Terminus, V3.2-Exp): <｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}
    "deepseek_v31": _DEEPSEEK,
    # DeepSeek V3 and R1-0528: the call's type and name, then its arguments in a JSON fence.
    "deepseek_v3": dataclasses.replace(
        _DEEPSEEK,
        name="deepseek_v3",
        separator="\n",
        name_prefix=("function", _DS_SEP),
        arguments_marker="\n```json\n",
        arguments_end="\n```",
    ),
    # Gemma 4: <|tool_call>call:name{key:<|"|>text<|"|>,n:3}<tool_call|> for each call.
    "gemma4": ToolCallFormat(
        "gemma4", _GEMMA_CALL, _GEMMA_CALL_END, "arguments", "", markers=(GEMMA_QUOTE,)
    ),
    # Kimi K2: <|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}, the
    # header being the call's id.
    "kimi_k2": ToolCallFormat(
        "kimi_k2",
        _KIMI_CALL,
        _KIMI_CALL_END,
        "arguments",
        "",
        (_KIMI_SECTION,),
        (_KIMI_SECTION_END,),
        arguments_marker=_KIMI_ARGUMENTS,
        name_prefix=("functions.",),
        call_index=True,
        spaced=True,
    ),
}
# Mistral Small 3.2, Magistral, Devstral (v11 on): each call its own marker, then the name.
_MISTRAL_V11 = ToolCallFormat(
    "mistral",
    _MISTRAL,
    "",
    "arguments",
    "",
    arguments_marker="[ARGS]",
    short_ids=True,
    spaced=True,
)


def tool_call_format(
    name: str, chat_template: str | None = None, tokenizer: Any = None
) -> ToolCallFormat:
    """The format of parser ``name``; for ``mistral``, the one its ``chat_template`` writes
    (``[ARGS]``: v11's; before, ``[TOOL_CALLS] [`` or ``[TOOL_CALLS][``). With the
    ``tokenizer``, the format's markers that are one special token of it are named by their
    ids in the grammar, and its JSON is spaced as the tokenizer's chat template writes an
    earlier call's (Qwen's and Llama's ``tojson``: ``", "`` and ``": "``; the demo pair's:
    compact), so a forced call reads as the calls the model saw.

    Raises:
        ValueError: an unknown parser.
    """
    if name not in _FORMATS:
        raise ValueError(f"tool_call_parser must be one of {list(PARSERS)}, got {name!r}")
    form = _FORMATS[name]
    if form.name in _GLM_NAMES and tokenizer is not None:
        form = dataclasses.replace(form, xml=_glm_markup(tokenizer) or form.xml)
    if name == "mistral" and chat_template and "[ARGS]" in chat_template:
        form = _MISTRAL_V11
    elif name == "mistral" and chat_template and f"{_MISTRAL} [" not in chat_template:
        form = dataclasses.replace(form, opening=(_MISTRAL, "["))
    if tokenizer is None:
        return form
    added, special = added_token_ids(tokenizer), special_token_ids(tokenizer)
    # The added tokens in the format's pieces (a piece may be one, or hold one: hermes's
    # "<tool_call>\n" holds Qwen's <tool_call>).
    ids = tuple((text, i) for text, i in added.items() if any(text in p for p in form.pieces))
    # (a template that writes the arguments as given shows the client's spacing, not its own)
    spaced = None if form.arguments_text else _template_spacing(tokenizer)
    return dataclasses.replace(
        form,
        marker_ids=ids,
        special_text=any(piece in special for piece, _ in ids),
        spaced=form.spaced if spaced is None else spaced,
    )


_PROBE_ARGUMENTS = {"osd_probe_a": 1, "osd_probe_b": 2}


def _probe_call_text(tokenizer: Any) -> str | None:
    """The tokenizer's chat template's text of a conversation with one earlier call (of
    ``osd_probe``, arguments ``_PROBE_ARGUMENTS``); None: no template, or one that refuses it."""
    call = {"name": "osd_probe", "arguments": dict(_PROBE_ARGUMENTS)}
    probe = {"id": "osdprobe1", "type": "function", "function": call}
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [probe]},
    ]
    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    except Exception:  # noqa: BLE001 - a template may refuse anything; then it shows nothing
        return None


def _template_spacing(tokenizer: Any) -> bool | None:
    """Whether the tokenizer's chat template writes an earlier call's arguments spaced (True)
    or compact (False); None: it shows none (no template, one that refuses the probe, or one
    that writes calls another way)."""
    text = _probe_call_text(tokenizer)
    if text is None:
        return None
    if json.dumps(_PROBE_ARGUMENTS) in text:
        return True
    if json.dumps(_PROBE_ARGUMENTS, separators=(",", ":")) in text:
        return False
    return None


_GLM_NAMES = ("glm45", "glm47")
_GLM_PROBE = re.compile(
    r"<tool_call>osd_probe(?P<name>\s*)<arg_key>osd_probe_a</arg_key>(?P<key>\s*)"
    r"<arg_value>1</arg_value>(?P<item>\s*)<arg_key>"
)


def _glm_markup(tokenizer: Any) -> XmlMarkup | None:
    """GLM's layout as the tokenizer's chat template writes an earlier call: the whitespace
    after the name, between a key and its value, after a value (GLM-4.5's newlines, GLM-4.7's
    none); None where the template shows none."""
    text = _probe_call_text(tokenizer)
    found = None if text is None else _GLM_PROBE.search(text)
    if found is None:
        return None
    key = _GLM_KEY.format(key="{key}", between=found["key"])
    return XmlMarkup("{name}" + found["name"], key, "</arg_value>", found["item"], "")


def speaks_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes OpenAI's harmony messages (gpt-oss's)."""
    markers = ("<|channel|>", "<|message|>", "<|call|>")
    return chat_template is not None and all(m in chat_template for m in markers)


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template asks for; None: it shows no known tool-call format."""
    if not chat_template:
        return None
    if speaks_harmony(chat_template):
        return "openai"  # gpt-oss's (serving.harmony)
    if _DS_CALLS in chat_template:
        return "deepseek_v3" if "```json" in chat_template else "deepseek_v31"
    if _KIMI_SECTION in chat_template:
        return "kimi_k2"
    if _GEMMA_CALL in chat_template:
        return "gemma4"
    if "<tool_call>" in chat_template and "<function=" in chat_template:
        return "qwen3_coder"
    if "<arg_key>" in chat_template:
        return "glm45"
    if "<tool_call>" in chat_template:
        return "hermes"
    if _MISTRAL in chat_template:
        return "mistral"
    if "func_name1(" in chat_template:  # pythonic templates show [func_name1(params_name1=...)]
        return "pythonic"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
# Formats whose calls sit in a section: its marker, each call's markers, the section's end.
_SECTIONS = frozenset({"deepseek_v3", "deepseek_v31", "kimi_k2"})
# Kimi K2's call header: the name, then the call's number.
_NUMBERED = re.compile(r"(?P<name>.+?):\d+")
_PYTHON_TAG = "<|python_tag|>"


class ToolCallScanner:
    """Reads one reply as it streams; :meth:`feed` and :meth:`finish` say what can go out.

    Args:
        parser: one of ``PARSERS``.
        functions: the offered functions' names (a call of another name stays content).
        parallel: false keeps the first call only (OpenAI's ``parallel_tool_calls: false``).
        schemas: the functions' parameters' schemas by name: ``qwen3_coder`` reads each
            value as its parameter's type (without: every value is a string).
    """

    def __init__(
        self,
        parser: str,
        functions: Sequence[str],
        parallel: bool = True,
        schemas: Mapping[str, Any] | None = None,
    ) -> None:
        if parser == "openai":
            raise ValueError("harmony replies are read by serving.harmony")
        self._format = tool_call_format(parser)
        self._functions = frozenset(functions)
        self._schemas = dict(schemas or {})
        self._parallel = parallel
        self._pending = ""  # text not yet given out
        # Inside a call, what arrives is kept in parts until the call can end (its close in
        # the text's last characters, or the reply's end): a long call is not copied and
        # searched again on every piece.
        self._parts: list[str] = []
        self._tail = ""  # the open call's last characters, where its close may begin
        self._in_call = False  # hermes: inside <tool_call> ... </tool_call>; sections: inside
        self._gap = ""  # hermes, mistral: the whitespace before the open call (its text if no call)
        self._opened = ""  # sections: the opening marker, until it went out or a call was read
        self._section_read = False  # sections: a call of the open section was read
        form = self._format
        # The markers around each call where calls are read one by one between them
        # (hermes's, and the formats that take its <tool_call>; Gemma 4's own).
        gemma = form.name == "gemma4"
        self._open = _GEMMA_CALL if gemma else _HERMES_OPEN
        self._close = _GEMMA_CALL_END if gemma else _HERMES_CLOSE
        # What ends a stretch inside a call (or a section) that is worth reading: none
        # (mistral's calls are read at the end).
        self._closes: tuple[str, ...] = (
            (form.end, *form.closing)
            if form.name in _SECTIONS
            else ()
            if form.name == "mistral"
            else (self._close,)
        )
        self._mode: str | None = None  # llama3_json: "calls" or "text", once decided
        self._cut = False  # the reply ended at its token limit (finish)
        self.calls: list[ParsedCall] = []

    @property
    def called(self) -> bool:
        return bool(self.calls)

    @property
    def closes(self) -> tuple[str, ...]:
        """The markers that end a call (or a section of calls) in this format; none where
        calls are read at the reply's end."""
        return self._closes

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Takes the next piece of the reply; returns (content to send, calls completed)."""
        if self._in_call:
            window = self._tail + text
            if not any(close in window for close in self._closes):
                self._parts.append(text)
                self._tail = window[-self._longest_close :]
                return "", []
        self._pending += "".join(self._parts) + text
        self._parts.clear()
        read = self._read(final=False)
        self._tail = self._pending[-self._longest_close :]
        return read

    @property
    def _longest_close(self) -> int:
        """How many of the last characters may hold the start of a close (at least one)."""
        return max((len(close) - 1 for close in self._closes), default=0) or 1

    def finish(self, cut: bool = False) -> tuple[str, list[ParsedCall]]:
        """The reply ended: everything held back goes out (an unfinished call as content,
        unless its format forgives the missing close: :meth:`_unclosed_call`; never where
        the reply was ``cut`` by its token limit)."""
        self._pending += "".join(self._parts)
        self._parts.clear()
        self._cut = cut
        return self._read(final=True)

    def _read(self, final: bool) -> tuple[str, list[ParsedCall]]:
        if self._format.name in ("hermes", "qwen3_coder", "gemma4", *_GLM_NAMES):
            return self._hermes(final)
        if self._format.name == "mistral":
            return self._mistral(final)
        if self._format.name in _SECTIONS:
            return self._section(final)
        if self._format.name in _PYTHONIC_NAMES:
            return self._whole(final, ("[", _PYTHON_START), self._pythonic_calls, _may_call)
        return self._whole(final, ("{", _PYTHON_TAG, _PYTHON_START), self._llama_calls)

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
        return _parsed(value["name"], arguments)

    def _closed_xml(self) -> bool:
        return self._pending.rstrip().endswith("</function>")

    def _xml_call(self, body: str) -> ParsedCall | None:
        """Qwen3-Coder's ``<function=name>`` and its ``<parameter=key>`` values (a missing
        ``</parameter>`` or ``</function>`` forgiven, as vLLM's parser does); None: other text
        around them, or a function not offered."""
        function = _XML_FUNCTION.fullmatch(body.strip())
        if function is None or function["name"] not in self._functions:
            return None
        properties = self._properties(function["name"])
        arguments: dict[str, Any] = {}
        for parameter in _XML_PARAMETER.finditer(function["parameters"]):
            value = parameter["value"].removeprefix("\n").removesuffix("\n")
            arguments[parameter["key"]] = _xml_value(value, properties.get(parameter["key"]))
        if _XML_PARAMETER.sub("", function["parameters"]).strip():
            return None
        return _parsed(function["name"], arguments)

    def _body_call(self, body: str) -> ParsedCall | None:
        """The call between ``<tool_call>`` and ``</tool_call>``, read as the format writes it."""
        if self._format.name == "qwen3_coder":
            return self._xml_call(body)
        if self._format.name in _GLM_NAMES:
            return self._glm_call(body)
        if self._format.name == "gemma4":
            return self._gemma_call(body)
        return self._read_call(body.strip(), ("arguments", "parameters"))

    def _glm_call(self, body: str) -> ParsedCall | None:
        """GLM's name and its ``<arg_key>`` / ``<arg_value>`` pairs (a string's value as it is
        written, any other as its schema types it); None: other text among them, or a function
        not offered."""
        name, opened, rest = body.partition("<arg_key>")
        name = name.strip()
        if name not in self._functions:
            return None
        rest = opened + rest
        properties = self._properties(name)
        arguments: dict[str, Any] = {}
        for pair in _GLM_ARGUMENT.finditer(rest):
            key = pair["key"].strip()
            arguments[key] = _xml_value(pair["value"], properties.get(key))
        if _GLM_ARGUMENT.sub("", rest).strip():
            return None
        return _parsed(name, arguments)

    def _gemma_call(self, body: str) -> ParsedCall | None:
        """Gemma 4's ``call:name{...}`` (:func:`serving.call_values.gemma_arguments`); None:
        other text around it, arguments that do not read, or a function not offered."""
        call = _GEMMA_BODY.fullmatch(body.strip())
        if call is None or call["name"] not in self._functions:
            return None
        arguments = gemma_arguments(call["arguments"])
        return None if arguments is None else _parsed(call["name"], arguments)

    def _unclosed_call(self) -> ParsedCall | None:
        """A call the reply ended in before its close, read where it is whole, as vLLM
        reads it: Qwen3-Coder's that closed its function but not ``<tool_call>``; Gemma 4's
        whose arguments' braces closed (its end-of-turn token, which ends the reply, written
        instead of ``<tool_call|>``). None: the client gets its text."""
        if self._cut:
            return None
        if self._format.name == "qwen3_coder" and self._closed_xml():
            return self._xml_call(self._pending)
        if self._format.name == "gemma4":
            return self._gemma_call(self._pending)
        return None

    def _properties(self, name: str) -> dict[str, Any]:
        """The parameters' schemas of function ``name`` by parameter (empty: unknown)."""
        schema = self._schemas.get(name) or {}
        properties = schema.get("properties") if isinstance(schema, dict) else None
        return properties if isinstance(properties, dict) else {}

    def _hermes(self, final: bool) -> tuple[str, list[ParsedCall]]:
        content, calls = "", list[ParsedCall]()
        while True:
            if self._in_call:
                end = self._pending.find(self._close)
                if end < 0:
                    if final:  # an unfinished call: the client gets its text
                        call = self._unclosed_call()
                        if call is None:
                            content += self._gap + self._open + self._pending
                        else:
                            calls += self._accept(call)
                        self._pending, self._in_call = "", False
                    return content, calls
                body = self._pending[:end]
                self._pending = self._pending[end + len(self._close) :]
                self._in_call = False
                parsed = self._body_call(body)
                if parsed is None:
                    content += self._gap + self._open + body + self._close
                else:
                    calls += self._accept(parsed)
                continue
            start = self._pending.find(self._open)
            if start >= 0:
                # Whitespace between content and a call (or between calls) is the format's.
                before = self._pending[:start]
                content += before.rstrip()
                self._gap = before[len(before.rstrip()) :]
                self._pending = self._pending[start + len(self._open) :]
                self._in_call = True
                continue
            if final:
                rest = self._pending if not self.calls else self._pending.strip()
                content, self._pending = content + rest, ""
                return content, calls
            keep = held_back(self._pending, self._open)
            out = self._pending[: len(self._pending) - keep]
            # Trailing whitespace waits: it is dropped if a call follows.
            stripped = out.rstrip()
            if self.calls and not stripped:
                return content, calls
            content += stripped
            self._pending = self._pending[len(stripped) :]
            return content, calls

    def _whole(
        self,
        final: bool,
        starts: tuple[str, ...],
        read: Callable[[str], list[ParsedCall] | None],
        may_call: Callable[[str], bool] | None = None,
    ) -> tuple[str, list[ParsedCall]]:
        """A reply that is calls or text as a whole (llama3_json's, pythonic): calls where
        it starts with one of ``starts`` (held back and read once complete), else text,
        streamed as it comes. ``may_call``: whether the held text may still begin calls
        (where not, it is text from there on: pythonic's ``[1, 2] are ...``)."""
        if self._mode is None:
            head = self._pending.lstrip()
            if head.startswith(starts):
                self._mode = "calls"
            elif head and not any(start.startswith(head) for start in starts):
                self._mode = "text"
            elif not final:
                return "", []
            else:
                self._mode = "text"
        if self._mode == "calls" and may_call is not None and not may_call(self._pending):
            self._mode = "text"
        if self._mode == "text":
            content, self._pending = self._pending, ""
            return content, []
        if not final:  # the calls are read when the reply is complete
            return "", []
        text = self._pending.strip()
        self._pending = ""
        parsed = read(text)
        if parsed is None:
            return text, []
        return "", [call for p in parsed for call in self._accept(p)]

    def _section(self, final: bool) -> tuple[str, list[ParsedCall]]:
        """DeepSeek's and Kimi K2's calls: a section marker, then each call between its own
        markers, then the section's end. Content streams until the section (or a call's
        marker, where a model leaves the section's out); each call goes out once its end
        arrived. A call that does not read as one of an offered function stays content, and
        so does an unfinished one; text after the section is content."""
        form = self._format
        opening, closing = form.opening[0], form.closing[0]
        content, calls = "", list[ParsedCall]()
        while True:
            if not self._in_call:
                found = [
                    (at, m) for m in (opening, form.start) if (at := self._pending.find(m)) >= 0
                ]
                if not found:
                    if final:  # (whitespace alone after calls is the format's)
                        rest = "" if self.calls and not self._pending.strip() else self._pending
                        self._pending = ""
                        return content + rest, calls
                    keep = held_back(self._pending, opening, form.start)
                    out = self._pending[: len(self._pending) - keep].rstrip()
                    self._pending = self._pending[len(out) :]
                    return content + out, calls  # (trailing whitespace waits)
                at, marker = min(found)
                before = self._pending[:at]
                content += before.rstrip()
                self._gap = before[len(before.rstrip()) :]
                self._opened = marker if marker == opening else ""
                self._pending = self._pending[at + len(self._opened) :]
                self._in_call, self._section_read = True, False
                continue
            body = self._pending.lstrip()
            if body.startswith(closing):
                if not self._section_read:  # a section without calls: its text goes out
                    space = self._pending[: len(self._pending) - len(body)]
                    content += self._gap + self._opened + space + closing
                self._pending, self._in_call = body[len(closing) :], False
                continue
            if body.startswith(form.start):
                end = body.find(form.end)
                if end >= 0:
                    text = body[: end + len(form.end)]
                    self._pending = body[len(text) :]
                    call = self._section_call(body[len(form.start) : end])
                    if call is None:  # not a call: its text, and the section's, go out
                        content += self._gap + self._opened + text
                    else:
                        calls += self._accept(call)
                        self._section_read = True
                    self._opened = self._gap = ""
                    continue
            elif body and not (closing.startswith(body) or form.start.startswith(body)):
                # Text inside the section that is no call: the section ended without its marker.
                content += "" if self._section_read else self._gap + self._opened
                self._in_call = False
                continue
            if final:  # an unfinished call: the client gets its text
                content += self._gap + self._opened + self._pending
                self._pending, self._in_call = "", False
            return content, calls

    def _section_call(self, body: str) -> ParsedCall | None:
        """One call between its markers: the name (after the format's prefix, before its
        ``:N`` with Kimi K2), the arguments' marker and the arguments' JSON object."""
        form = self._format
        assert form.arguments_marker is not None
        header, marker, arguments = body.partition(form.arguments_marker.strip())
        if not marker:
            return None
        name = header.strip()
        for piece in form.name_prefix:
            name = name.removeprefix(piece).lstrip()
        call_id = None
        if form.call_index:
            numbered = _NUMBERED.fullmatch(name)
            if numbered is not None:
                name, call_id = numbered["name"], header.strip()
        arguments = arguments.strip()
        if form.arguments_end:
            arguments = arguments.removesuffix(form.arguments_end.strip()).rstrip()
        call = call_of_arguments(name, arguments, self._functions) if arguments else None
        return (
            call if call is None or call_id is None else dataclasses.replace(call, call_id=call_id)
        )

    def _mistral(self, final: bool) -> tuple[str, list[ParsedCall]]:
        """Content streams until the first ``[TOOL_CALLS]``; what follows is calls, read when
        the reply is complete (all of them, or it goes out as content)."""
        content = ""
        if not self._in_call:
            start = self._pending.find(_MISTRAL)
            if start < 0:
                keep = 0 if final else held_back(self._pending, _MISTRAL)
                out = self._pending[: len(self._pending) - keep]
                content = out if final else out.rstrip()  # whitespace waits for what follows
                self._pending = self._pending[len(content) :]
                return content, []
            before = self._pending[:start]
            content = before.rstrip()
            self._gap = before[len(content) :]
            self._pending, self._in_call = self._pending[start:], True
        if not final:
            return content, []
        text, self._pending, self._in_call = self._pending, "", False
        parsed = self._mistral_calls(text)
        if parsed is None:
            return content + self._gap + text, []
        calls, rest = parsed
        return content + rest, [call for p in calls for call in self._accept(p)]

    def _mistral_calls(self, text: str) -> tuple[list[ParsedCall], str] | None:
        """Every call after each marker: a JSON list or object of calls (before v11), or the
        name, an optional ``[CALL_ID]`` and ``[ARGS]``, and the arguments' object (v11); and
        the text after the last call (content, as vLLM's parser leaves it). None: a part that
        is not calls of offered functions."""
        calls = list[ParsedCall]()
        parts = text.split(_MISTRAL)[1:]
        rest = ""
        for number, part in enumerate(parts, 1):
            part = part.strip()
            named = _MISTRAL_NAMED.match(part)
            body = part if named is None else part[named.end() :]
            values, end = _json_prefix(body)
            if not values or (end < len(body) and number < len(parts)):
                return None
            rest = body[end:]
            if named is not None:  # v11: one object, the arguments
                values = [{"name": named["name"], "arguments": values[0]}, *values[1:]]
            for value in values:
                for item in value if isinstance(value, list) else [value]:
                    call = self._call_of(item, ("arguments", "parameters"))
                    if call is None:
                        return None
                    calls.append(call)
        return (calls, rest.strip()) if calls else None

    def _pythonic_calls(self, text: str) -> list[ParsedCall] | None:
        read = [
            _parsed(name, arguments) if name in self._functions else None
            for name, arguments in _python_calls(text) or []
        ]
        calls = [call for call in read if call is not None]
        return calls if calls and len(calls) == len(read) else None

    def _llama_calls(self, text: str) -> list[ParsedCall] | None:
        text = text.removeprefix(_PYTHON_TAG).removeprefix(_PYTHON_START)
        text = text.strip().removesuffix(_PYTHON_END).strip()  # (Llama 4's)
        calls = [
            self._call_of(value, ("parameters", "arguments")) for value in _json_values(text) or []
        ]
        read = [call for call in calls if call is not None]
        return read if read and len(read) == len(calls) else None


def call_of_arguments(name: str, text: str, functions: Collection[str]) -> ParsedCall | None:
    """A call of ``name`` whose arguments are the JSON object ``text`` (empty: none); None:
    a function not among ``functions``, or text that is not such an object."""
    if name not in functions:
        return None
    try:
        arguments = _JSON.decode(text or "{}")
    except ValueError:
        return None
    return _parsed(name, arguments) if isinstance(arguments, dict) else None


def _parsed(name: str, arguments: dict[str, Any]) -> ParsedCall | None:
    text = _dumps(arguments)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\\ud800"): the UTF-8 answer cannot hold it
        return None
    return ParsedCall(name, text)


# A key Gemma's notation can write bare: none of the characters that end a key or a value.
_GEMMA_BARE_KEY = re.compile(r"[^:,{}\[\]\"\s]+")
# (``call`` left out, as some Gemma 4 checkpoints write it: vLLM's parser reads it too)
_GEMMA_BODY = re.compile(r"(?:call)?:(?P<name>[^{\s:]+)\{(?P<arguments>.*)\}", re.DOTALL)
_XML_FUNCTION = re.compile(
    r"<function=(?P<name>[^>\n]+)>(?P<parameters>.*?)(?:</function>\s*)?", re.DOTALL
)
_XML_PARAMETER = re.compile(
    r"<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL
)
_GLM_ARGUMENT = re.compile(
    r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL
)
_NOT_READ = object()


def _xml_value(text: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema types it: ``null`` (where the type allows
    it, or is not a string), an integer, a number (as written), a boolean, an object or array
    (JSON, or a Python literal); the text itself where it is a string, or parses as none of
    its types."""
    schema = schema if isinstance(schema, dict) else {}
    kinds = schema.get("type")
    types = set(kinds if isinstance(kinds, list) else [kinds] if isinstance(kinds, str) else [])
    if text == "null" and ("null" in types or "string" not in types):
        return None
    words = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if (not types and _xml_string(schema)) or (words and all(isinstance(w, str) for w in words)):
        return text  # (a string enum's words are text, as the grammar writes them)
    try:
        value = _JSON.decode(text)
    except ValueError:
        value = _NOT_READ
    if not types:  # an enum or a combination of schemas: JSON if it is
        return text if value is _NOT_READ else value
    for kind in sorted(types - {"string", "null"}):
        if kind == "integer" and type(value) is int:
            return value
        if kind == "number" and (type(value) is int or isinstance(value, _Number)):
            return value
        if kind == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
        wanted = {"object": dict, "array": list}.get(kind)
        if wanted is not None:
            if isinstance(value, wanted):
                return value
            literal = _literal(text)
            if isinstance(literal, wanted):
                return literal
    return text


def _literal(text: str) -> Any:
    """``text`` as a Python literal of JSON's types (``{'a': (1, 2)}``: ``{"a": [1, 2]}``), as
    vLLM falls back to; None where it is not one."""
    text = text.strip()
    try:
        return _python_literal(ast.parse(text, mode="eval").body, text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


# A v11 call after its marker: the name, an optional call id, the arguments' marker.
_MISTRAL_NAMED = re.compile(
    r"(?P<name>[A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?(?:\[ARGS\])?\s*(?=\{)"
)


def _json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` is, one after another (apart by whitespace, commas or
    semicolons); None: not that, or empty."""
    values, end = _json_prefix(text)
    return values if values and end == len(text) else None


def _json_prefix(text: str) -> tuple[list[Any], int]:
    """The JSON values ``text`` begins with (apart by whitespace, commas or semicolons), and
    where the text after them begins."""
    values, at = list[Any](), 0
    while at < len(text):
        try:
            value, after = _JSON.raw_decode(text, at)
        except ValueError:  # not JSON, or NaN / Infinity
            break
        values.append(value)
        rest = re.match(r"[\s,;]*", text[after:])
        at = after + (rest.end() if rest else 0)
    return values, at


_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
# The start of a pythonic call list, whole or in part.
_PYTHONIC_HEAD = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_PYTHONIC_HEAD_PART = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")


def _may_call(text: str) -> bool:
    """Whether a reply that begins with ``text`` may be pythonic calls: it begins with
    ``[name(``, or with what may still grow into that."""
    text = text.lstrip()
    if text.startswith(_PYTHON_START):
        text = text.removeprefix(_PYTHON_START).lstrip()
    if not text or _PYTHONIC_HEAD.match(text):
        return True
    part = _PYTHONIC_HEAD_PART.match(text)
    return part is not None and part.end() == len(text)


_PYTHON_NAMES = {"true": True, "false": False, "null": None}


def _python_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """A pythonic reply's calls, ``[name(key=value, ...), ...]`` (Llama 4's between
    ``<|python_start|>`` and ``<|python_end|>`` too): each call's name and arguments, values
    read as Python literals (and JSON's ``true``, ``false``, ``null``); None: anything else."""
    text = text.strip()
    if text.startswith(_PYTHON_START):
        text = text.removeprefix(_PYTHON_START).strip().removesuffix(_PYTHON_END).strip()
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments: dict[str, Any] = {}
        for given in node.keywords:
            if given.arg is None or given.arg in arguments:
                return None
            try:
                arguments[given.arg] = _python_literal(given.value, text)
            except (ValueError, RecursionError):
                return None
        calls.append((node.func.id, arguments))
    return calls


def _python_literal(node: ast.expr, source: str) -> Any:
    """A literal's value as JSON holds it (a number with a fraction as written)."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or value is None or isinstance(value, str | int):
            return value
        written = ast.get_source_segment(source, node) or ""
        if isinstance(value, float) and JSON_NUMBER.fullmatch(written):
            return _Number(written)  # (as written: 1e999 stays 1e999, not infinity)
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise ValueError("not a JSON value")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _python_literal(node.operand, source)
        if isinstance(node.op, ast.UAdd) and isinstance(value, _Number | int | float):
            return value
        if isinstance(value, _Number):
            text = value.text
            return _Number(text[1:] if text.startswith("-") else "-" + text)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value
        raise ValueError("not a number")
    if isinstance(node, ast.Name) and node.id in _PYTHON_NAMES:
        return _PYTHON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_python_literal(item, source) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [key.value if isinstance(key, ast.Constant) else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("keys are not strings")
        return {k: _python_literal(v, source) for k, v in zip(keys, node.values, strict=True)}
    raise ValueError("not a literal")


def held_back(text: str, *markers: str) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``markers``."""
    longest = max(len(marker) for marker in markers)
    for size in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-size:]
        if any(marker.startswith(tail) for marker in markers):
            return size
    return 0
