"""Checks of one request's arguments for :meth:`osd.decode.engine.SpeculativeDecoder.prepare`.

Each refusal is a :class:`osd.errors.ParamError` naming the argument, so a server's 400 says
which field to fix. The sampling arguments are checked by
:class:`osd.decode.sampling.SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from osd.decode.limits import MAX_DRAFTS, MAX_LOGPROBS, MAX_SPEC_TOKENS
from osd.decode.methods import METHODS, PROPOSER_CHOICES
from osd.decode.sampling import SamplingParams
from osd.errors import ParamError

__all__ = [
    "check_bias",
    "check_options",
    "prompt_ids",
]


def check_options(
    *,
    method: str,
    num_spec_tokens: object,
    num_drafts: int,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    proposer: str = "auto",
) -> None:
    """Raises :class:`ParamError` for a method, proposer, k, K, token budget or logprobs out of
    range."""
    if method not in METHODS:
        raise ParamError("method", f"method must be one of {list(METHODS)}, got {method!r}")
    if proposer not in PROPOSER_CHOICES:
        raise ParamError(
            "proposer", f"proposer must be one of {list(PROPOSER_CHOICES)}, got {proposer!r}"
        )
    if not isinstance(num_spec_tokens, int) or not 1 <= num_spec_tokens <= MAX_SPEC_TOKENS:
        raise ParamError(
            "num_spec_tokens",
            f"num_spec_tokens (k) must be in 1..{MAX_SPEC_TOKENS}, got {num_spec_tokens}",
        )
    if not 1 <= num_drafts <= MAX_DRAFTS:
        raise ParamError(
            "num_drafts", f"num_drafts (K) must be in 1..{MAX_DRAFTS}, got {num_drafts}"
        )
    if max_tokens < 0:
        raise ParamError("max_tokens", f"max_tokens must be >= 0, got {max_tokens}")
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ParamError(name, f"{name} must be in 0..{MAX_LOGPROBS} or None, got {value}")


def check_bias(params: SamplingParams, vocab_size: int) -> None:
    """Raises :class:`ParamError` if ``logit_bias`` names a token outside the vocabulary."""
    outside = [t for t, _ in params.logit_bias if t >= vocab_size]
    if outside:
        raise ParamError(
            "logit_bias",
            f"logit_bias names token ids outside the vocabulary of {vocab_size}: {outside[:5]}",
        )


def prompt_ids(prompt: str | Sequence[int], tokenizer: Any, vocab_size: int) -> list[int]:
    """The prompt's token ids; raises :class:`ParamError` for an empty prompt, ids outside the
    vocabulary, or text without a tokenizer."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ParamError("prompt", "a text prompt needs a tokenizer; pass token ids instead")
        ids = list(tokenizer(prompt)["input_ids"])
        bos, bos_text = (
            getattr(tokenizer, "bos_token_id", None),
            getattr(tokenizer, "bos_token", None),
        )
        if bos is not None and bos_text and prompt.startswith(bos_text) and ids[:2] == [bos, bos]:
            ids = ids[1:]  # the text writes its own (a chat template's): not twice
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ParamError("prompt", "prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ParamError("prompt", f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    return ids


def fitted_budget(prompt_len: int, max_tokens: int, context: int, fit: bool) -> int:
    """The tokens a request may generate beside its prompt in ``context`` positions:
    ``max_tokens``, cut to the room left where ``fit``; raises :class:`ParamError` when the
    prompt leaves no room, or (not ``fit``) when the budget does not fit: OpenAI's and vLLM's
    refusal, not a silently shorter answer."""
    if prompt_len >= context:
        raise ParamError("prompt", f"prompt has {prompt_len} tokens; the context holds {context}")
    if prompt_len + max_tokens > context and not fit:
        raise ParamError(
            "max_tokens",
            f"this model's context holds {context} tokens; the request needs "
            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} in the "
            "completion): lower max_tokens or shorten the prompt",
        )
    return min(max_tokens, context - prompt_len)
