"""OpenAI's ``logprobs`` objects from the engine's per-token log probabilities.

Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where
each ``top_logprobs`` entry maps the n most likely tokens' text to their logprob and, as OpenAI
does, always holds the sampled token too (up to n + 1 entries). Chat: ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``. A token's text is its
own decoding; a token that is part of a multi-byte character decodes to U+FFFD. The numbers
are the target's raw logprobs (:mod:`osd.decode.logprobs` says why).

Completions' ``echo`` puts the prompt before the completion: in the text (the prompt as sent, or
the token ids' decoding) and, with ``logprobs``, in front of the tokens, the first prompt
token's logprob and alternatives ``null`` (nothing precedes it), as OpenAI and vLLM answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from osd.decode.generation import TokenLogprob

__all__ = ["LogprobFormatter", "echo_prefix"]


def echo_prefix(request: Any, prompt_ids: Sequence[int], tokenizer: Any) -> tuple[str, list[int]]:
    """What a completion with ``echo`` starts with: the prompt's text and ids ("", [] without)."""
    if not getattr(request, "echo", False):
        return "", []
    if isinstance(request.prompt, str):
        return request.prompt, list(prompt_ids)
    text = "" if tokenizer is None else tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return str(text), list(prompt_ids)


class LogprobFormatter:
    """Formats one response's logprobs, chunk by chunk (text offsets carry on across chunks)."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self._tokenizer = tokenizer
        self._chat = chat
        self._offset = 0
        # Special tokens (a prompt's BOS) are not in the returned text: they take no offset.
        self._special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def _text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        text: str = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def format(
        self, token_ids: list[int], entries: Sequence[TokenLogprob | None] | None
    ) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice (or streamed chunk) with these tokens; None if off.

        An entry None (an echoed prompt's first token, completions only) has null logprobs.
        """
        if entries is None:
            return None
        texts = [self._text(t) for t in token_ids]
        if self._chat:
            return {
                "content": [
                    {
                        **self._chat_token(text, entry.logprob),
                        "top_logprobs": [
                            self._chat_token(self._text(i), lp) for i, lp in entry.top
                        ],
                    }
                    for text, entry in zip(texts, entries, strict=True)
                    if entry is not None
                ]
            }
        offsets = []
        for token_id, text in zip(token_ids, texts, strict=True):
            offsets.append(self._offset)
            self._offset += 0 if token_id in self._special else len(text)
        return {
            "tokens": texts,
            "token_logprobs": [None if entry is None else entry.logprob for entry in entries],
            "top_logprobs": [
                None
                if entry is None
                else {**{self._text(i): lp for i, lp in entry.top}, text: entry.logprob}
                for text, entry in zip(texts, entries, strict=True)
            ],
            "text_offset": offsets,
        }

    @staticmethod
    def _chat_token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
