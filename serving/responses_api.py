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
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from serving.openai_fields import HARMLESS
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


def _is_default(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: any(value == a and type(value) is type(a) for a in (None, *allowed))


def _is_empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


# Every top-level field of a Responses request: "used" (read below), "harmless" (accepted and
# ignored: nothing a client sees changes), or a check of the field's no-op value and what any
# other value asks for (refused: 400 unsupported_parameter).
_USED = "used"
_HARMLESS = "harmless"
RESPONSES_FIELDS: Mapping[str, str | tuple[Callable[[Any], bool], str]] = {
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
    "stream_options": _HARMLESS,  # include_obfuscation: osd pads nothing
    "store": _HARMLESS,  # answered store: false (vLLM's answer without its store)
    "metadata": _USED,  # answered back, as OpenAI does
    "user": _HARMLESS,
    "safety_identifier": _HARMLESS,
    "prompt_cache_key": _HARMLESS,
    "prompt_cache_retention": _HARMLESS,
    "prompt_cache_options": _HARMLESS,
    "service_tier": (_is_default("auto", "default"), "a latency or price tier"),
    "truncation": (_is_default("disabled"), "input items dropped to fit the context"),
    "previous_response_id": (
        _is_default(),
        "a stored response to continue (osd stores none: send the conversation in input)",
    ),
    "conversation": (
        _is_default(),
        "a stored conversation (osd stores none: send the conversation in input)",
    ),
    "prompt": (_is_default(), "a stored prompt template"),
    "background": (_is_default(False), "a response run in the background and polled"),
    "background_options": (_is_empty, "a response run in the background"),
    "max_tool_calls": (_is_default(), "a limit on OpenAI's hosted tools' calls"),
    "moderation": (_is_default(), "moderation of the input and output"),
    "context_management": (_is_empty, "OpenAI's compaction of long contexts"),
    "access_programs": (_is_empty, "OpenAI's programs"),
    "image": (_is_default(), "image generation"),
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


# What the chat request's errors name, as the Responses request spells it.
_RESPONSES_SPELLINGS = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "logprobs": "include",
}


def responses_error(error: APIError) -> APIError:
    """``error`` of the chat request a Responses request ran as, naming the Responses field
    (a message's field: ``input``, whose items need not map one to one onto messages)."""
    param = error.param
    if param is None:
        return error
    if param.startswith("messages"):
        param = "input"
    spelled = _RESPONSES_SPELLINGS.get(param)
    if spelled is not None:
        error.message = error.message.replace(param, spelled)
        param = spelled
    error.param = param
    return error


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _unsupported(param: str, asks: str, value: Any) -> APIError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return _bad(
        f"{param} is not supported by osd: it asks for {asks}, which osd does not provide "
        f"(got {shown}); leave it out or send its default",
        param,
        "unsupported_parameter",
    )


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
        logprobs: Mapping[str, Any] | None,
        usage: Mapping[str, Any],
        stats: Any = None,
    ) -> dict[str, Any]:
        """The whole Response of a chat answer read in ``deltas`` (as streamed deltas, in the
        order the reply said them: the items come out in the order a stream gives them), its
        tokens' ``logprobs`` (chat's, given to the first text)."""
        events = ResponseEvents(self)
        events.start()
        for delta in deltas:
            given = logprobs if delta.get("content") else None
            logprobs = None if given is not None else logprobs
            events.feed({"choices": [{"delta": delta, "logprobs": given, "finish_reason": None}]})
        events.feed({"choices": [{"delta": {}, "finish_reason": finish_reason}]})
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
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _output_text(text: str, logprobs: list[Any] | None, asked: bool) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if asked:
        part["logprobs"] = logprobs or []
    return part


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
        if kind is None or (kind == _HARMLESS and name in HARMLESS):
            # vLLM's extras and osd's own: the chat request judges them (the harmless ones
            # it knows too: their types)
            chat[name] = value
        elif isinstance(kind, tuple) and not kind[0](value):
            raise _unsupported(name, kind[1], value)
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
    effort = _reasoning_effort(data.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    include = data.get("include")
    if include is not None and not (
        isinstance(include, list) and all(isinstance(x, str) for x in include)
    ):
        raise _bad("include must be a list of strings", "include", "invalid_type")
    logprobs = LOGPROBS_INCLUDE in (include or [])
    top = data.get("top_logprobs")
    if logprobs or top:
        chat["logprobs"], logprobs = True, True
        if top is not None:
            chat["top_logprobs"] = top
    if data.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    metadata = data.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad("metadata must be an object of strings", "metadata", "invalid_type")
    echo = {
        "instructions": instructions,
        "max_output_tokens": data.get("max_output_tokens"),
        "metadata": metadata or {},
        "parallel_tool_calls": data.get("parallel_tool_calls", True),
        "reasoning": {"effort": effort, "summary": None},
        "temperature": data.get("temperature", 1.0),
        "text": {"format": (data.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": data.get("tool_choice", "auto"),
        "tools": tools or [],
        "top_logprobs": top or 0,
        "top_p": data.get("top_p", 1.0),
        "user": data.get("user"),
    }
    return ResponsesRequest(chat, echo, logprobs)


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
    thinking = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{path} must be an object", path, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(path, item)
            if message["role"] == "assistant" and thinking:
                message["reasoning"], thinking = thinking, ""
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
            if thinking:
                last["reasoning"], thinking = thinking, ""
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(f"{path}.output", output)
            call_id = _string(item, "call_id", path)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            parts = [*(item.get("content") or []), *(item.get("summary") or [])]
            thinking = _parts_text(f"{path}.content", parts) if parts else ""
        elif kind == "item_reference":
            raise _unsupported(f"{path}.type", "a stored item (osd stores none)", kind)
        else:
            raise _unsupported(
                f"{path}.type", "an item of OpenAI's hosted tools (osd runs function tools)", kind
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


def _parts_text(path: str, parts: Any) -> str:
    """Text parts joined by newlines (as chat's are); other parts refused by type."""
    if not isinstance(parts, list):
        raise _bad(f"{path} must be a string or a list of parts", path, "invalid_type")
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


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools in chat's shape."""
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools", "invalid_type")
    shaped = []
    for i, tool in enumerate(tools):
        path = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _unsupported(
                f"{path}.type", "one of OpenAI's hosted tools (osd runs function tools)", kind
            )
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise _bad(f"{path}.{unknown[0]} is not a field of a function tool", path)
        shaped.append({"type": "function", "function": function})
    return shaped


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _unsupported("tool_choice", "a choice of OpenAI's hosted tools or allowed_tools", choice)


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
    if form is None or form == {"type": "text"}:
        return {}
    if not isinstance(form, dict):
        raise _bad("text.format must be an object", "text.format", "invalid_type")
    if form.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if form.get("type") == "json_schema":
        schema = {k: v for k, v in form.items() if k != "type"}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise _bad("text.format.type must be text, json_object or json_schema", "text.format.type")


def _reasoning_effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise _bad("reasoning must be an object", "reasoning", "invalid_type")
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise _bad(f"reasoning.{unknown[0]} is not a field of reasoning", "reasoning")
    return reasoning.get("effort")


class ResponseEvents:
    """A streamed chat answer's chunks as Responses' events, in the order OpenAI sends them:
    ``response.created``, each output item added, its deltas, done, then
    ``response.completed`` (``response.incomplete`` where the token limit cut it)."""

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
            if delta.get("reasoning"):
                events += self._write("reasoning", delta["reasoning"], None)
            if delta.get("content"):  # (logprobs: of the tokens that wrote it)
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                events += self._write("message", delta["content"], logprobs)
            for call in delta.get("tool_calls") or []:
                events += self._close() + self._call(call)
            self._finish = choice.get("finish_reason") or self._finish
        return events

    def finish(self, usage: Mapping[str, Any] | None, stats: Any) -> list[dict[str, Any]]:
        """The last events: the open item done, then the whole response."""
        events = self._close()
        if not self.output:  # nothing said: an empty message, as a whole answer has
            events += self._write("message", "", None) + self._close()
        response = self._request.envelope(
            self._id, self._created, self.output, self._finish or "stop", usage, stats
        )
        done = "incomplete" if response["status"] == "incomplete" else "completed"
        return [*events, self._event(f"response.{done}", response=response)]

    def fail(self, error: Mapping[str, Any]) -> list[dict[str, Any]]:
        """An error after the stream began: ``error``, then ``response.failed``."""
        code = error.get("code") or error.get("type") or "server_error"
        message = error.get("message", "")
        response = self._request.envelope(self._id, self._created, self.output, None, None)
        response["status"], response["error"] = "failed", {"code": code, "message": message}
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

    def _write(self, kind: str, text: str, logprobs: list[Any] | None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        asked = self._request.logprobs
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = _reasoning_item(_new_id("rs"), "", "in_progress")
            else:
                item = _message_item(_new_id("msg"), None, "in_progress")
            self._open = item
            index = len(self.output)
            events.append(self._event("response.output_item.added", output_index=index, item=item))
            if kind == "message":
                part = _output_text("", [], asked)
                events.append(self._in_part("response.content_part.added", part=part))
        self._text += text
        if kind == "reasoning":
            return [*events, self._in_part("response.reasoning_text.delta", delta=text)]
        extra: dict[str, Any] = {}
        if asked:
            self._logprobs += logprobs or []
            extra["logprobs"] = logprobs or []
        return [*events, self._in_part("response.output_text.delta", delta=text, **extra)]

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        text, index = self._text, len(self.output)
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], text)
            events = [self._in_part("response.reasoning_text.done", text=text)]
        else:
            asked = self._request.logprobs
            part = _output_text(text, self._logprobs, asked)
            done = _message_item(item["id"], part, "completed")
            extra = {"logprobs": self._logprobs} if asked else {}
            events = [
                self._in_part("response.output_text.done", text=text, **extra),
                self._in_part("response.content_part.done", part=part),
            ]
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
