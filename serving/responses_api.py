"""OpenAI's Responses API (``POST /v1/responses``) on the chat path.

A Responses request is read into a chat completions request (:func:`read_responses_request`):
``instructions`` and ``input`` become the messages (input items: messages, earlier
``function_call`` and ``function_call_output`` items, ``reasoning`` items given to the next
assistant turn as its thinking), function ``tools`` and ``tool_choice`` their chat shape,
``text.format`` the ``response_format``, ``reasoning.effort`` the ``reasoning_effort``,
``max_output_tokens`` the token limit, ``top_logprobs`` with ``include:
["message.output_text.logprobs"]`` the chat's logprobs. The chat's answer is written back as a
Response (:meth:`ResponsesRequest.response`): the thinking as a ``reasoning`` item, the text as
a ``message`` item, each call as a ``function_call`` item; a stream as Responses' typed events
(:class:`ResponseEvents`), which the official client's ``responses.stream`` accumulates.

Every field of ``openai.types.responses.ResponseCreateParams`` is implemented, accepted as
harmless or refused unless default (:data:`RESPONSES_FIELDS`; a test reads them from the
installed package), as ``serving.openai_fields`` does for chat. Fields outside the Responses
API go on to the chat request, so vLLM's sampling extras (``top_k``, ``seed``, ``stop`` ...) and
osd's own (``draft``, ``spec``, ``log`` ...) work here too, and are refused there by name where
osd does not do them; chat's own spellings of Responses fields (``messages``, ``max_tokens``,
``response_format`` ...) are refused with the Responses field to send instead.

osd stores no responses: ``store`` is answered ``false`` (as vLLM does without its store), and
``previous_response_id``, ``conversation`` and item references, which need stored ones, are
refused: a client sends the conversation in ``input``. Only function tools run; OpenAI's hosted
tools (web search, file search, code interpreter, ...) are refused by type.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

from serving.openai_fields import (
    HARMLESS,
    Harmless,
    Refused,
    is_empty,
    is_false,
    is_null,
    is_one_of,
    unsupported_message,
)
from serving.protocol import APIError

__all__ = [
    "RESPONSES_FIELDS",
    "ResponseEvents",
    "ResponsesRequest",
    "read_responses_request",
    "response_events",
    "responses_error",
]

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


_USED = "used"
# Every top-level field of a Responses request: used (read below), harmless (accepted and
# ignored: nothing a client sees changes; those chat knows go on to it for their type check,
# the others are checked here), or refused unless it has its no-op value (a 400
# unsupported_parameter naming it), as serving.openai_fields classifies chat's.
RESPONSES_FIELDS: Mapping[str, str | Harmless | Refused] = {
    "model": _USED,
    "input": _USED,
    "instructions": _USED,
    "max_output_tokens": _USED,
    "temperature": _USED,
    "top_p": _USED,
    "top_logprobs": _USED,
    "include": _USED,  # logprobs; the other includes name items osd never answers
    "tools": _USED,
    "tool_choice": _USED,
    "parallel_tool_calls": _USED,
    "text": _USED,  # format; verbosity refused unless "medium"
    "reasoning": _USED,  # effort; summary: osd answers the thinking itself, not a summary
    "stream": _USED,
    "metadata": _USED,  # answered back, as OpenAI does
    "stream_options": Harmless("include_obfuscation: osd pads nothing", _is_object, "an object"),
    "store": Harmless(
        "answered store: false (vLLM's answer without its store)", _is_bool, "a boolean"
    ),
    "max_tool_calls": Harmless(
        "a limit on OpenAI's own tools' calls, which osd never makes",
        lambda value: type(value) is int,
        "an integer",
    ),
    **{name: HARMLESS[name] for name in HARMLESS if name not in ("metadata", "request_id")},
    "service_tier": Refused("a latency or price tier", is_one_of("auto", "default")),
    "truncation": Refused("input items dropped to fit the context", is_one_of("disabled")),
    "previous_response_id": Refused(
        "a stored response to continue (osd stores none: send the conversation in input)",
        is_null,
    ),
    "conversation": Refused(
        "a stored conversation (osd stores none: send the conversation in input)", is_null
    ),
    "prompt": Refused("a stored prompt template", is_null),
    "background": Refused("a response run in the background and polled", is_false),
    "background_options": Refused("a response run in the background", is_empty),
    "moderation": Refused("moderation of the input and output", is_null),
    "context_management": Refused("OpenAI's compaction of long contexts", is_empty),
    "access_programs": Refused("OpenAI's programs", is_empty),
    "image": Refused("image generation", is_null),
}
# Chat's spellings that the Responses API renames: refused, naming what to send instead.
_CHAT_SPELLINGS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": 'top_logprobs with include: ["message.output_text.logprobs"]',
    "reasoning_effort": "reasoning.effort",
    "n": "one request per answer",
}
# Input content parts that are text; the others are refused by type.
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


# What the chat request's errors name, as the Responses request spells it (by prefix; a
# message's field is ``input``'s, whose items need not map one to one onto messages).
_RESPONSES_SPELLINGS = [
    (re.compile(r"^messages(\[\d+\])?"), "input"),
    (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
    (re.compile(r"^logprobs$"), "include"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
]


def responses_error(error: APIError) -> APIError:
    """``error`` of the chat request a Responses request ran as, naming the Responses field
    (in its param and its message)."""
    param = error.param
    if param is None:
        return error
    for pattern, spelled in _RESPONSES_SPELLINGS:
        renamed = pattern.sub(spelled, param, count=1)
        if renamed != param:
            error.message = error.message.replace(param, renamed)
            error.param = renamed
            break
    return error


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _unsupported(param: str, asks: str, value: Any) -> APIError:
    return _bad(unsupported_message(param, asks, value), param, "unsupported_parameter")


@dataclass
class ResponsesRequest:
    """A Responses request read: the chat request it runs as, and what its answer echoes.

    Attributes:
        chat: the chat completions request's body.
        echo: the request's fields a Response repeats (instructions, tools, tool_choice, ...).
        logprobs: the output text carries its tokens' log probabilities.
    """

    chat: dict[str, Any]
    echo: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False

    def response(
        self,
        deltas: list[Mapping[str, Any]],
        finish_reason: str | None,
        logprobs: list[Any] | None,
        usage: Mapping[str, Any],
        stats: Any = None,
    ) -> dict[str, Any]:
        """The whole Response of a chat answer read in ``deltas`` (as streamed deltas, in the
        order the reply said them), by the events a stream sends. ``logprobs``: every
        generated token's (chat's entries), given to the message where the reply is all
        message (which tokens wrote which item of a reply with thinking or calls is not
        tracked: its message then carries none)."""
        plain = all(not (d.get("reasoning") or d.get("tool_calls")) for d in deltas)
        given = {"content": logprobs} if plain and logprobs else None
        events = ResponseEvents(self)
        events.start()
        for delta in deltas:
            events.feed({"choices": [{"delta": delta, "logprobs": given}]})
            given = None if delta.get("content") else given
        events.feed({"choices": [{"delta": {}, "logprobs": given, "finish_reason": finish_reason}]})
        response: dict[str, Any] = events.finish(usage, stats)[-1]["response"]
        return response

    def envelope(
        self,
        response_id: str,
        created_at: int,
        output: list[dict[str, Any]],
        finish_reason: str | None,
        usage: Mapping[str, Any] | None,
        stats: Any = None,
    ) -> dict[str, Any]:
        """A Response object; ``finish_reason`` None: still in progress."""
        status, incomplete = "in_progress", None
        if finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif finish_reason is not None:
            status = "completed"
        response = {
            "id": response_id,
            "object": "response",
            "created_at": created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.chat["model"],
            "output": output,
            "usage": None if usage is None else _usage(usage),
            **self.echo,
            "previous_response_id": None,
            "store": False,
            "background": False,
            "truncation": "disabled",
        }
        if stats is not None:
            response["osd"] = stats
        return response


def _usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _output_text(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, part: dict[str, Any] | None, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [] if part is None else [part],
    }


def _call_item(item_id: str, call: Mapping[str, Any], status: str) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if status == "completed" else "",
        "status": status,
    }


def read_responses_request(data: Any) -> ResponsesRequest:
    """The chat request a Responses request runs as; raises :class:`APIError` (400) naming
    the field it cannot take."""
    if not isinstance(data, dict):
        raise _bad("the request body must be a JSON object")
    chat: dict[str, Any] = {}
    for name, value in data.items():
        if name in _CHAT_SPELLINGS and name not in RESPONSES_FIELDS:
            raise _bad(
                f"{name} is a chat completions field; the Responses API takes "
                f"{_CHAT_SPELLINGS[name]} instead",
                name,
                "unknown_parameter",
            )
        kind = RESPONSES_FIELDS.get(name)
        if kind is None or (isinstance(kind, Harmless) and name in HARMLESS):
            # vLLM's extras and osd's own: the chat request judges them (the harmless ones
            # it knows too: their types)
            chat[name] = value
        elif isinstance(kind, Harmless) and value is not None and not kind.fits(value):
            raise _bad(f"{name} must be {kind.said}", name, "invalid_type")
        elif isinstance(kind, Refused) and not kind.is_default(value, data):
            raise _unsupported(name, kind.asks, value)
    if "model" not in data:
        raise _bad("model is required", "model")
    chat["model"] = data["model"]
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions must be a string", "instructions", "invalid_type")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    chat["messages"] = messages + _messages(data.get("input"))
    _copy(data, chat, "temperature", "top_p", "parallel_tool_calls", "stream")
    if data.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = data["max_output_tokens"]
    tools = data.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    choice = data.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
    chat.update(_text_format(data.get("text")))
    reasoning = _reasoning(data.get("reasoning"))
    effort = reasoning.get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    include = data.get("include")
    if include is not None and not (
        isinstance(include, list) and all(isinstance(x, str) for x in include)
    ):
        raise _bad("include must be a list of strings", "include", "invalid_type")
    # As OpenAI's: the output text's logprobs where include asks for them, top_logprobs
    # alternatives at each.
    logprobs = LOGPROBS_INCLUDE in (include or [])
    top = data.get("top_logprobs")
    if logprobs:
        chat["logprobs"] = True
        if top is not None:
            chat["top_logprobs"] = top
    if data.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    metadata = data.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad("metadata must be an object of strings", "metadata", "invalid_type")
    text = data.get("text") or {}
    echo = {
        "instructions": instructions,
        "max_output_tokens": data.get("max_output_tokens"),
        "metadata": metadata or {},
        "parallel_tool_calls": _given(data, "parallel_tool_calls", True),
        "reasoning": {"effort": effort, "summary": reasoning.get("summary")},
        "temperature": _given(data, "temperature", 1.0),
        "text": {
            "format": text.get("format") or {"type": "text"},
            "verbosity": text.get("verbosity") or "medium",
        },
        "tool_choice": _given(data, "tool_choice", "auto"),
        "tools": tools or [],
        "top_logprobs": top or 0,
        "top_p": _given(data, "top_p", 1.0),
        "user": data.get("user"),
    }
    return ResponsesRequest(chat, echo, logprobs)


def _given(data: Mapping[str, Any], name: str, default: Any) -> Any:
    """A field as sent, its default where it was left out or null."""
    value = data.get(name)
    return default if value is None else value


def _copy(source: Mapping[str, Any], target: dict[str, Any], *names: str) -> None:
    for name in names:
        if source.get(name) is not None:
            target[name] = source[name]


def _messages(items: Any) -> list[dict[str, Any]]:
    """Chat messages of a request's ``input``: a string (one user message) or its items."""
    if items is None:
        raise _bad("input is required: a string or a list of input items", "input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("input must be a string or a list of input items", "input", "invalid_type")
    messages: list[dict[str, Any]] = []
    # Reasoning items' text, for the assistant turn that follows them (dropped where another
    # turn comes first: a template shows an assistant's own thinking only).
    thinking: list[str] = []

    def think(message: dict[str, Any]) -> None:
        if thinking:
            message["reasoning"] = "\n".join(filter(None, [message.get("reasoning"), *thinking]))
            thinking.clear()

    for i, item in enumerate(items):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{path} must be an object", path, "invalid_type")
        # (OpenAI's item reference may leave its type out: an id without a role)
        kind = item.get("type") or (
            "item_reference" if "id" in item and "role" not in item else "message"
        )
        if kind == "message":
            message = _message(path, item)
            if message["role"] == "assistant":
                think(message)
            thinking.clear()
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", path),
                "type": "function",
                "function": {
                    "name": _string(item, "name", path),
                    "arguments": _string(item, "arguments", path),
                },
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            think(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(f"{path}.output", output)
            call_id = _string(item, "call_id", path)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            thinking.clear()
        elif kind == "reasoning":
            for name in ("content", "summary"):
                parts = item.get(name)
                if parts:
                    thinking.append(_parts_text(f"{path}.{name}", parts, lists_only=True))
        elif kind == "item_reference":
            raise _unsupported(f"{path}.type", "a stored item (osd stores none)", kind)
        else:
            raise _unsupported(
                f"{path}.type",
                "an item osd does not take (it takes messages, function calls and their "
                "outputs, and reasoning: not OpenAI's own tools' calls or compaction)",
                kind,
            )
    return messages


def _message(path: str, item: Mapping[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise _bad(
            f"{path}.role must be user, system, developer or assistant, got {role!r}",
            f"{path}.role",
        )
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(f"{path}.content", content)
    return {"role": role, "content": text}


def _parts_text(path: str, parts: Any, lists_only: bool = False) -> str:
    """Text parts joined by newlines (as chat's are); other parts refused by type."""
    if not isinstance(parts, list):
        shape = "a list of parts" if lists_only else "a string or a list of parts"
        raise _bad(f"{path} must be {shape}", path, "invalid_type")
    texts = []
    for j, part in enumerate(parts):
        where = f"{path}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            if kind in ("input_image", "input_file", "input_audio", "refusal"):
                raise _unsupported(f"{where}.type", f"{kind.removeprefix('input_')} input", kind)
            raise _bad(f"{where} must be a text part ({', '.join(_TEXT_PARTS)})", where)
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: Mapping[str, Any], name: str, path: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise _bad(f"{path}.{name} must be a string", f"{path}.{name}", "invalid_type")
    return value


# A function tool's fields beyond chat's, each with its no-op values and what another asks for.
_TOOL_DEFAULTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "defer_loading": ((False,), "a tool loaded only when searched for"),
    "allowed_callers": ((["direct"],), "calls from OpenAI's programs"),
    "output_schema": ((), "a schema of the tool's output"),
}


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools in chat's shape."""
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools", "invalid_type")
    shaped = []
    for i, tool in enumerate(tools):
        path = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{path} must be an object", path, "invalid_type")
        kind = tool.get("type")
        if kind != "function":
            raise _unsupported(
                f"{path}.type", "a tool of OpenAI's own (osd runs function tools)", kind
            )
        function = {}
        for name, value in tool.items():
            if name == "type" or value is None:
                continue
            if name in _TOOL_DEFAULTS:
                allowed, asks = _TOOL_DEFAULTS[name]
                if value not in allowed:
                    raise _unsupported(f"{path}.{name}", asks, value)
            elif name not in ("name", "description", "parameters", "strict"):
                raise _bad(
                    f"{path}.{name} is not a field of a function tool",
                    f"{path}.{name}",
                    "unknown_parameter",
                )
            else:
                function[name] = value
        shaped.append({"type": "function", "function": function})
    return shaped


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _unsupported("tool_choice", "a choice of OpenAI's own tools or allowed_tools", choice)


def _text_format(text: Any) -> dict[str, Any]:
    """``text``'s ``format`` as chat's ``response_format`` (none for plain text)."""
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise _bad("text must be an object", "text", "invalid_type")
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise _unsupported("text.verbosity", "a reasoning model's verbosity", verbosity)
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise _bad(f"text.{unknown[0]} is not a field of text", f"text.{unknown[0]}")
    form = text.get("format")
    if form is None:
        return {}
    if not isinstance(form, dict):
        raise _bad("text.format must be an object", "text.format", "invalid_type")
    kind = form.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise _bad("text.format.type must be text, json_object or json_schema", "text.format.type")
    schema_fields = {"type", "name", "schema", "strict", "description"}
    extra = sorted(set(form) - (schema_fields if kind == "json_schema" else {"type"}))
    if extra:
        raise _bad(
            f"text.format.{extra[0]} is not a field of a {kind} format",
            f"text.format.{extra[0]}",
            "unknown_parameter",
        )
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    schema = {k: v for k, v in form.items() if k != "type"}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _reasoning(reasoning: Any) -> dict[str, Any]:
    """``reasoning``'s fields (``effort`` is used; a summary is answered as the thinking)."""
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise _bad("reasoning must be an object", "reasoning", "invalid_type")
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise _bad(
            f"reasoning.{unknown[0]} is not a field of reasoning",
            f"reasoning.{unknown[0]}",
            "unknown_parameter",
        )
    return reasoning


class ResponseEvents:
    """A streamed chat answer's chunks as Responses' events, in the order OpenAI sends them:
    ``response.created``, each output item added, its content part added, its deltas, done,
    then ``response.completed`` (``response.incomplete``, and the last item ``incomplete``,
    where the token limit cut it). A chunk's log probabilities go to the message it writes,
    or is writing (the end-of-sequence token's comes in a chunk of its own)."""

    def __init__(self, request: ResponsesRequest) -> None:
        self._request = request
        self._id = _new_id("resp")
        self._created = int(time.time())
        self._sequence = 0
        self.output: list[dict[str, Any]] = []  # items done
        self._open: dict[str, Any] | None = None  # the item being written
        self._text = ""
        self._logprobs: list[Any] = []
        self._finish: str | None = None

    def start(self) -> list[dict[str, Any]]:
        response = self._request.envelope(self._id, self._created, [], None, None)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def feed(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (``usage`` alone: none)."""
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if not self._request.logprobs:
                logprobs = []
            if delta.get("reasoning"):
                events += self._write("reasoning", delta["reasoning"], [])
            content = delta.get("content") or ""
            if self._open is None and self.output and self.output[-1]["type"] == "function_call":
                content = content.lstrip()  # (the whitespace after a call is the format's)
            if content:
                events += self._write("message", content, logprobs)
            elif self._open is not None and self._open["type"] == "message":
                self._logprobs += logprobs
            for call in delta.get("tool_calls") or []:
                events += self._close() + self._call(call)
            self._finish = choice.get("finish_reason") or self._finish
        return events

    def finish(self, usage: Mapping[str, Any] | None, stats: Any) -> list[dict[str, Any]]:
        """The last events: the open item done, then the whole response."""
        finish = self._finish or "stop"
        ending = "incomplete" if finish == "length" else "completed"
        events = self._close(ending)
        if not self.output:  # nothing said: an empty message, as a whole answer has
            events += self._write("message", "", []) + self._close(ending)
        response = self._request.envelope(
            self._id, self._created, self.output, finish, usage, stats
        )
        done = "incomplete" if response["status"] == "incomplete" else "completed"
        return [*events, self._event(f"response.{done}", response=response)]

    def fail(self, error: Mapping[str, Any]) -> list[dict[str, Any]]:
        """An error after the stream began: ``error`` (osd's code), then ``response.failed``
        (OpenAI's code for it: a request's grammar that failed is an invalid prompt)."""
        code = error.get("code") or error.get("type") or "server_error"
        message = error.get("message", "")
        kind = "invalid_prompt" if error.get("type") == "invalid_request_error" else "server_error"
        response = self._request.envelope(self._id, self._created, self.output, None, None)
        response["status"], response["error"] = "failed", {"code": kind, "message": message}
        return [
            self._event("error", code=code, message=message, param=error.get("param")),
            self._event("response.failed", response=response),
        ]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _in_part(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event of the open item's (only) content part."""
        assert self._open is not None
        where = {"item_id": self._open["id"], "output_index": len(self.output)}
        return self._event(kind, **where, content_index=0, **fields)

    def _write(self, kind: str, text: str, logprobs: list[Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = _reasoning_item(_new_id("rs"), "", "in_progress")
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = _message_item(_new_id("msg"), None, "in_progress")
                part = _output_text("")
            self._open = item
            index = len(self.output)
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            events.append(self._in_part("response.content_part.added", part=part))
        self._text += text
        if kind == "reasoning":
            return [*events, self._in_part("response.reasoning_text.delta", delta=text)]
        self._logprobs += logprobs
        return [*events, self._in_part("response.output_text.delta", delta=text, logprobs=logprobs)]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        text, index = self._text, len(self.output)
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], text, status)
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            events = [self._in_part("response.reasoning_text.done", text=text)]
        else:
            part = _output_text(text, self._logprobs)
            done = _message_item(item["id"], part, status)
            events = [
                self._in_part("response.output_text.done", text=text, logprobs=self._logprobs)
            ]
        events.append(self._in_part("response.content_part.done", part=part))
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self._open, self._text, self._logprobs = None, "", []
        return events

    def _call(self, call: Mapping[str, Any]) -> list[dict[str, Any]]:
        """A completed call (osd streams each call once its arguments are whole)."""
        index, item_id = len(self.output), _new_id("fc")
        added = _call_item(item_id, call, "in_progress")
        done = _call_item(item_id, call, "completed")
        where = {"item_id": item_id, "output_index": index}
        arguments = done["arguments"]
        self.output.append(done)
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.function_call_arguments.delta", **where, delta=arguments),
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=done["name"],
                arguments=arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=done),
        ]


async def response_events(
    request: ResponsesRequest, chat_events: AsyncGenerator[bytes]
) -> AsyncGenerator[bytes]:
    """A chat answer's server-sent events (``data: {chunk}``) as a Response's (closing the
    chat's events when closed: the client left)."""
    events = ResponseEvents(request)
    usage: Mapping[str, Any] | None = None
    stats: Any = None
    failed = False
    for event in events.start():
        yield _sse(event)
    async with contextlib.aclosing(chat_events):
        async for raw in chat_events:
            for line in raw.decode().split("\n\n"):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    failed = True
                    for event in events.fail(chunk["error"]):
                        yield _sse(event)
                    continue
                usage = chunk.get("usage") or usage
                stats = chunk.get("osd") or stats
                for event in events.feed(chunk):
                    yield _sse(event)
    if not failed:
        for event in events.finish(usage, stats):
            yield _sse(event)


def _sse(event: Mapping[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
