"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt's or a chat's token ids as the server
would read them (clients count tokens and fit prompts with them), and token ids back to text.

``POST /tokenize`` takes ``{"prompt": text or ids}`` or ``{"messages": [...], "tools": [...],
"chat_template_kwargs": {...}}`` (``model`` optional; the chat is rendered as
``/v1/chat/completions`` renders it, generation prompt included) and answers ``{"count",
"max_model_len", "tokens", "token_strs"}`` (``token_strs`` with ``return_token_strs: true``,
else null). ``POST /detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": text}``.
Other fields are refused by name.
"""

from __future__ import annotations

from typing import Any

from osd.decode.request_checks import prompt_ids
from osd.errors import ParamError
from serving.protocol import APIError, ChatRequest, parse_request
from serving.runtime import ReplicaRuntime

__all__ = ["detokenize", "tokenize"]

_PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT_FIELDS = frozenset(
    {"model", "messages", "tools", "chat_template_kwargs", "return_token_strs"}
    | {"add_special_tokens", "add_generation_prompt", "continue_final_message"}
)
# vLLM's rendering switches, at the values the chat endpoint renders with (others refused).
_CHAT_DEFAULTS = {
    "add_special_tokens": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
}
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize(runtime: ReplicaRuntime, data: Any) -> dict[str, Any]:
    """The token ids of ``data``'s prompt or chat; raises :class:`APIError` (4xx)."""
    chat = isinstance(data, dict) and "messages" in data
    _check_body(data, _CHAT_FIELDS if chat else _PROMPT_FIELDS, "messages" if chat else "prompt")
    model = data.get("model") or runtime.config.serve.model_name
    strs = data.get("return_token_strs") or False
    if not isinstance(strs, bool):
        raise APIError(400, "return_token_strs must be a boolean", param="return_token_strs")
    defaults = _CHAT_DEFAULTS if chat else {"add_special_tokens": True}
    for name, default in defaults.items():
        if data.get(name, default) not in (None, default):
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            raise APIError(
                400,
                f"{name}: {data[name]!r} is not supported: the text is read as {endpoint} reads it",
                param=name,
                code="unsupported_parameter",
            )
    if chat:
        fields = {
            "model": model,
            "messages": data["messages"],
            "tools": data.get("tools"),
            "chat_template_kwargs": data.get("chat_template_kwargs"),
        }
        request = parse_request("chat", {k: v for k, v in fields.items() if v is not None})
        runtime.check_model(request.model)
        assert isinstance(request, ChatRequest)
        prompt = runtime.prompt_of(request, runtime.tool_plan(request))
    else:
        runtime.check_model(model)
        prompt = data["prompt"]
        if not isinstance(prompt, str) and not _is_ids(prompt):
            raise APIError(400, "prompt must be a string or a list of token ids", param="prompt")
    try:
        ids = prompt_ids(prompt, runtime.tokenizer, runtime.engine.vocab_size)
    except ParamError as exc:
        raise APIError(400, str(exc), param="messages" if chat else exc.param) from None
    tokenizer = runtime.tokenizer
    return {
        "count": len(ids),
        "max_model_len": runtime.batch.max_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if strs and tokenizer else None,
    }


def detokenize(runtime: ReplicaRuntime, data: Any) -> dict[str, Any]:
    """The text of ``data``'s token ids; raises :class:`APIError` (4xx)."""
    _check_body(data, _DETOKENIZE_FIELDS, "tokens")
    runtime.check_model(data.get("model") or runtime.config.serve.model_name)
    tokens, vocab = data["tokens"], runtime.engine.vocab_size
    if not _is_ids(tokens):
        raise APIError(400, "tokens must be a list of token ids", param="tokens")
    outside = [t for t in tokens if not 0 <= t < vocab]
    if outside:
        raise APIError(400, f"token ids out of range [0, {vocab}): {outside[:5]}", param="tokens")
    if runtime.tokenizer is None:
        raise APIError(400, "this server has no tokenizer to decode with", param="tokens")
    return {"prompt": runtime.tokenizer.decode(tokens)}


def _check_body(data: Any, known: frozenset[str], required: str) -> None:
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(data) - known)
    if unknown:
        raise APIError(
            400,
            f"{unknown[0]} is not a field of this endpoint ({', '.join(sorted(known))})",
            param=unknown[0],
            code="unknown_parameter",
        )
    if data.get(required) is None:
        raise APIError(400, f"{required} is required", param=required)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)
