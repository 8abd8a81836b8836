"""Which request fields osd implements, which it accepts as harmless, and which it refuses.

A field the client sends is never silently dropped when it asks for something osd does not do:
a new user of the official ``openai`` client would otherwise get a 200 that ignored
``best_of`` or ``suffix`` and never know. Every top-level field of OpenAI's
completions and chat completions requests (``openai.types.CompletionCreateParams`` and
``openai.types.chat.CompletionCreateParams``; a test reads them from the installed package, so
a field a new version adds fails it until it is classified here), the vLLM extras clients
commonly send, and osd's own fields fall in one of three groups:

* **Implemented** (:data:`IMPLEMENTED`, plus osd's own fields on the request model): used.
* **Accepted and ignored** (:data:`HARMLESS`): ignoring them changes nothing a client can see in
  the answer. Each entry says why.
* **Refused unless default** (:data:`REFUSED`): a value that asks for behaviour osd does not
  provide is answered 400 ``unsupported_parameter`` naming the field. The field's no-op value
  (``best_of: 1``, ``store: false`` ...) is accepted, since common clients (LangChain
  and others) send defaults on every request.

A field in none of them (a typo such as ``max_token``) is refused with 400
``unknown_parameter`` naming it: a misspelt ``max_tokens`` silently ignored is the same failure
as an ignored ``best_of``. vLLM's extras get the same treatment as OpenAI's refused fields, so
a client written for vLLM that sends their defaults keeps working.

Every optional OpenAI or vLLM field sent as ``null`` means "the default", as in OpenAI's API;
such fields, and refused or harmless fields at their no-op value, are removed before the request
model validates the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HARMLESS",
    "Harmless",
    "IMPLEMENTED",
    "MESSAGE_HARMLESS",
    "MESSAGE_IMPLEMENTED",
    "MESSAGE_REFUSED",
    "PART_REFUSED",
    "REFUSED",
    "ROLE_REFUSED",
    "FieldRefused",
    "Refused",
    "check_fields",
    "check_messages",
    "is_empty",
    "is_false",
    "is_null",
    "is_one_of",
    "shown",
    "unsupported_message",
]

# Used by osd (serving.protocol's request models). The sampling penalties, logit_bias and
# min_p are implemented by the request model's own fields.
IMPLEMENTED: frozenset[str] = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "stream",
        "stream_options",  # include_usage
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_p",
        "stop_token_ids",  # vLLM's: token ids that end generation besides end-of-sequence
        "ignore_eos",  # vLLM's: end-of-sequence does not end generation
        "skip_special_tokens",  # vLLM's: false writes special tokens in the text
        "logprobs",  # completions: 0..20 alternatives (vLLM's bound); chat: a flag
        "top_logprobs",  # chat only (completions refuse it by name)
        "echo",  # completions: the prompt (and its logprobs) first; chat refuses it by name
        # Structured output (serving.structured_output), OpenAI's and vLLM's spellings.
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "n",  # 1..16 choices, each its own sample (osd.decode.choices)
        # Tool calling on chat (serving.tools); completions refuse tools by name.
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        # Chat: thinking read apart (serving.reasoning); completions change nothing by them.
        "include_reasoning",  # vLLM's: false leaves the thinking out of the answer
        # A reasoning model's effort, given to a chat template that takes it (gpt-oss's);
        # refused by the replica where the template does not.
        "reasoning_effort",
        "chat_template_kwargs",  # vLLM's: more arguments for the chat template
    }
)


@dataclass(frozen=True)
class Harmless:
    """A field accepted and ignored, because ignoring it changes nothing in the answer.

    Attributes:
        why: why ignoring it is harmless.
        fits: whether a value has its JSON type (OpenAI refuses another, even of a field it
            ignores).
        said: the type in an error message.
    """

    why: str
    fits: Callable[[Any], bool] = lambda value: isinstance(value, str)
    said: str = "a string"


def _strings_object(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


HARMLESS: Mapping[str, Harmless] = {
    "user": Harmless(
        "an end-user label for the provider's abuse monitoring; the text does not depend on it"
    ),
    "safety_identifier": Harmless("the same as user, under its newer name"),
    "metadata": Harmless(
        "tags for stored completions; osd stores none, and refuses store: true",
        _strings_object,
        "an object of strings",
    ),
    "prompt_cache_key": Harmless("a routing hint for OpenAI's prompt cache, best effort there"),
    "prompt_cache_retention": Harmless("how long OpenAI keeps a prompt cache; osd keeps none"),
    "prompt_cache_options": Harmless(
        "breakpoints and lifetimes of OpenAI's prompt cache; osd has none",
        lambda value: isinstance(value, dict),
        "an object",
    ),
    "request_id": Harmless(
        "vLLM's id for the request's logs; osd gives each answer an id of its own"
    ),
}


def is_false(value: Any, _: Mapping[str, Any]) -> bool:
    return value is None or value is False


def _is_int(*allowed: int) -> Callable[[Any, Mapping[str, Any]], bool]:
    def check(value: Any, _: Mapping[str, Any]) -> bool:
        return value is None or (type(value) is int and value in allowed)

    return check


def is_one_of(*allowed: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    def check(value: Any, _: Mapping[str, Any]) -> bool:
        return any(value == a and type(value) is type(a) for a in (None, *allowed))

    return check


def is_null(value: Any, _: Mapping[str, Any]) -> bool:
    # For fields whose mere presence asks for something (web_search_options: {} searches).
    return value is None


def is_empty(value: Any, _: Mapping[str, Any]) -> bool:
    return value is None or value == [] or value == {}


def _no_tool_choice(tools: str) -> Callable[[Any, Mapping[str, Any]], bool]:
    # "auto" without tools (or functions) chooses none: the same as not sending it.
    def check(value: Any, data: Mapping[str, Any]) -> bool:
        return value is None or value == "none" or (value == "auto" and not data.get(tools))

    return check


@dataclass(frozen=True)
class Refused:
    """A field osd does not implement.

    Attributes:
        asks: what a non-default value asks for, in the error message.
        is_default: whether a value (given the whole request) is the field's no-op.
    """

    asks: str
    is_default: Callable[[Any, Mapping[str, Any]], bool]


REFUSED: Mapping[str, Refused] = {
    # OpenAI, both endpoints
    "store": Refused("storing completions for later retrieval", is_false),
    "service_tier": Refused(
        "a latency or price tier; osd serves every request alike", is_one_of("auto", "default")
    ),
    # OpenAI completions
    "best_of": Refused("several candidates generated server-side", _is_int(1)),
    "suffix": Refused("text inserted after the completion (fill in the middle)", is_one_of("")),
    # OpenAI chat
    "functions": Refused("function calling (deprecated by OpenAI; send tools)", is_empty),
    "function_call": Refused(
        "function calling (deprecated by OpenAI; send tool_choice)", _no_tool_choice("functions")
    ),
    "audio": Refused("audio output", is_null),
    "modalities": Refused("output modalities other than text", is_one_of(["text"])),
    "prediction": Refused(
        "a predicted output as the draft; osd drafts with its own adapters", is_null
    ),
    "web_search_options": Refused("web search", is_null),
    "verbosity": Refused("a reasoning model's verbosity", is_one_of("medium")),
    "moderation": Refused("moderation of the input and output", is_null),
    # vLLM extras, with vLLM's defaults (which are osd's behaviour)
    "min_tokens": Refused("a minimum completion length", _is_int(0)),
    "spaces_between_special_tokens": Refused("special-token spacing in the text", is_one_of(True)),
    "include_stop_str_in_output": Refused("the stop string in the text", is_false),
    "add_generation_prompt": Refused("chat prompts without a generation prompt", is_one_of(True)),
    "continue_final_message": Refused("continuing the last assistant message", is_false),
    "use_beam_search": Refused("beam search", is_false),
    "length_penalty": Refused("beam search", is_one_of(1.0, 1)),
    "prompt_logprobs": Refused("log probabilities of the prompt tokens", _is_int(0)),
    "chat_template": Refused("a chat template of the client's", is_null),
    "truncate_prompt_tokens": Refused("prompt truncation", is_null),
    "priority": Refused("scheduling priorities", _is_int(0)),
    "add_special_tokens": Refused(
        "special tokens added to the prompt or not, against the endpoint's way",
        lambda value, data: value is None or value is ("messages" not in data),
    ),
    "allowed_token_ids": Refused("generation restricted to given token ids", is_null),
    "bad_words": Refused("words banned from the text", is_empty),
    "return_tokens_as_token_ids": Refused("logprob tokens spelt as token ids", is_false),
    "return_token_ids": Refused("the prompt's and completion's token ids", is_false),
    "guided_whitespace_pattern": Refused("a whitespace pattern for guided JSON", is_null),
    "guided_decoding_backend": Refused(
        "another guided-decoding library; osd compiles grammars with its own", is_null
    ),
    "logits_processors": Refused("logits processors of the client's", is_null),
    # Requests with a salt must not share cached prefixes with others: osd's prefix caching
    # knows no salt, so one is refused rather than ignored.
    "cache_salt": Refused("a prefix cache kept apart by a salt", is_null),
    "kv_transfer_params": Refused("KV cache transfer between instances", is_null),
    "vllm_xargs": Refused("vLLM's custom sampling arguments", is_empty),
    "mm_processor_kwargs": Refused("multimodal processing", is_empty),
    "media_io_kwargs": Refused("multimodal media loading", is_empty),
    "prompt_embeds": Refused("prompts as embeddings", is_null),
    "documents": Refused("documents given to the chat template", is_null),
}

# Required fields are left for the request model to report when null.
_REQUIRED = frozenset({"model", "prompt", "messages"})


class FieldRefused(ValueError):
    """A request field osd refuses: ``param`` names it, ``code`` says why."""

    def __init__(self, param: str, message: str, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_fields(data: Mapping[str, Any], own: Collection[str]) -> dict[str, Any]:
    """Refuses what osd does not do; returns the fields left for the request model.

    Args:
        data: the decoded JSON body of a completions or chat completions request.
        own: the request model's field names (osd's own fields among them).

    Returns:
        ``data`` without nulls for optional OpenAI or vLLM fields and without refused or
        harmless fields at their no-op value.

    Raises:
        FieldRefused: naming the first field that is refused (code ``unsupported_parameter``)
            or that nobody defines (``unknown_parameter``).
    """
    kept: dict[str, Any] = {}
    for name, value in data.items():
        refused = REFUSED.get(name)
        if refused is not None:
            if not refused.is_default(value, data):
                raise FieldRefused(
                    name, unsupported_message(name, refused.asks, value), "unsupported_parameter"
                )
            continue
        harmless = HARMLESS.get(name)
        if harmless is not None:
            _check_harmless_type(name, value, harmless)
            continue
        if name not in IMPLEMENTED and name not in own:
            raise FieldRefused(
                name,
                f"{name} is not a parameter osd knows (neither OpenAI's, vLLM's nor osd's "
                "own); check its spelling",
                "unknown_parameter",
            )
        if value is None and name in IMPLEMENTED and name not in _REQUIRED:
            continue  # OpenAI's null: the default (osd's own fields keep theirs for the model)
        kept[name] = value
    return kept


def _check_harmless_type(name: str, value: Any, harmless: Harmless) -> None:
    if value is not None and not harmless.fits(value):
        message = f"{name} must be {harmless.said}, got {shown(value)}"
        raise FieldRefused(name, message, "invalid_type")


def unsupported_message(name: str, asks: str, value: Any) -> str:
    """Why a refused field's value is refused (``asks``: what it asks for)."""
    return (
        f"{name} is not supported by osd: it asks for {asks}, which osd does not provide "
        f"(got {shown(value)}); leave it out or send its default"
    )


def shown(value: Any) -> str:
    """A value as an error message shows it (its first 60 characters)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Chat messages: the same three groups, one level down (``openai.types.chat.
# ChatCompletionMessageParam``'s fields; a test reads them from the installed package).
# Errors name the path: ``messages[1].tool_calls``, ``messages[0].content[2].image_url``.
# An assistant's earlier thinking: ``reasoning`` (vLLM's) or ``reasoning_content`` (DeepSeek's,
# and what Qwen3's templates read), given to the template as both.
MESSAGE_IMPLEMENTED: frozenset[str] = frozenset(
    {"role", "content", "tool_calls", "tool_call_id", "reasoning", "reasoning_content"}
)
MESSAGE_HARMLESS: Mapping[str, str] = {
    "name": "a participant's name: passed to the chat template with the message (templates "
    "that know it render it); osd's plain format without a template leaves it out",
}
MESSAGE_REFUSED: Mapping[str, Refused] = {
    "function_call": Refused("function calling (an assistant's earlier call)", is_null),
    "audio": Refused("audio output (an assistant's earlier audio answer)", is_null),
    "refusal": Refused("a refusal apart from the content (osd's models give none)", is_null),
}
# Roles osd does not serve (the others are the request model's to check).
ROLE_REFUSED: Mapping[str, str] = {"function": "function calling (a function's result)"}
# Content parts: text is used (a message's parts joined by newlines, as vLLM does); these
# are known and refused. A text part's prompt_cache_breakpoint is OpenAI's cache hint.
PART_REFUSED: Mapping[str, str] = {
    "image_url": "image input",
    "input_audio": "audio input",
    "file": "file input",
    "refusal": "a refusal apart from the content (osd's models give none)",
}
_TEXT_PART = frozenset({"type", "text", "prompt_cache_breakpoint"})


def check_messages(messages: Any) -> Any:
    """Refuses what osd does not do inside chat messages; returns them with text content.

    Each message keeps ``role``, ``content`` (a string: text parts joined by newlines; an
    assistant's null content is empty), ``name`` when given, an assistant's ``tool_calls`` and a
    tool's ``tool_call_id``. What is not a list of objects
    is returned as it is, for the request model to report.

    Raises:
        FieldRefused: naming the first refused or unknown field by its path.
    """
    if not isinstance(messages, list):
        return messages
    return [_check_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


def _check_message(path: str, message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    kept: dict[str, Any] = {}
    for name, value in message.items():
        refused = MESSAGE_REFUSED.get(name)
        if refused is not None:
            if not refused.is_default(value, message):
                raise _unsupported(f"{path}.{name}", refused.asks, value)
        elif name in MESSAGE_HARMLESS:
            if value is not None:
                kept[name] = value
        elif name not in MESSAGE_IMPLEMENTED:
            raise _unknown(f"{path}.{name}", "not a field of OpenAI's chat messages")
        else:
            kept[name] = value
    role = kept.get("role")
    if isinstance(role, str) and role in ROLE_REFUSED:
        raise _unsupported(f"{path}.role", ROLE_REFUSED[role], role)
    content = kept.get("content")
    if content is None and role == "assistant":
        kept["content"] = ""  # an assistant turn that only called tools
    elif isinstance(content, list):
        kept["content"] = "\n".join(
            _part_text(f"{path}.content[{j}]", part) for j, part in enumerate(content)
        )
    return kept


def _part_text(path: str, part: Any) -> Any:
    if not isinstance(part, dict):
        raise FieldRefused(path, f"{path} must be a content part object", "invalid_type")
    kind = part.get("type")
    if isinstance(kind, str) and kind in PART_REFUSED:
        raise _unsupported(f"{path}.{kind}", PART_REFUSED[kind], kind)
    if kind != "text":
        known = ", ".join(["text", *PART_REFUSED])
        raise _unknown(f"{path}.type", f"{shown(kind)} is not a content part type ({known})")
    unknown = sorted(set(part) - _TEXT_PART)
    if unknown:
        raise _unknown(f"{path}.{unknown[0]}", "not a field of OpenAI's text content parts")
    text = part.get("text")
    if not isinstance(text, str):
        raise FieldRefused(f"{path}.text", f"{path}.text must be a string", "invalid_type")
    return text


def _unsupported(param: str, asks: str, value: Any) -> FieldRefused:
    return FieldRefused(
        param,
        f"{param} is not supported by osd: it asks for {asks}, which osd does not provide "
        f"(got {shown(value)}); leave it out",
        "unsupported_parameter",
    )


def _unknown(param: str, why: str) -> FieldRefused:
    return FieldRefused(param, f"{param} is unknown to osd: {why}; check it", "unknown_parameter")
