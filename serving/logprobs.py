"""OpenAI's ``logprobs`` objects from the engine's per-token log probabilities.

Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where
each ``top_logprobs`` entry maps the n most likely tokens' text to their logprob and, as OpenAI
does, always holds the sampled token too (up to n + 1 entries). Chat: ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``. A token's text is its
own decoding; a token that holds only part of a multi-byte character (byte-level BPE, or a
SentencePiece byte fallback ``<0xE6>``) shows its bytes escaped (``"\\xe6\\x97"``, as DeepSeek
does; U+FFFD would make every such token, and every such alternative, the same), chat's
``bytes`` are the token's own (so a client joins them into the characters it splits, as
OpenAI documents), and completions' ``text_offset`` counts the characters of the text before
the token (a token that continues a character starts where that character does). The numbers
are the target's raw logprobs (:mod:`osd.decode.logprobs` says why).

Completions' ``echo`` puts the prompt before the completion: in the text (the prompt as sent, or
the token ids' decoding) and, with ``logprobs``, in front of the tokens, the first prompt
token's logprob and alternatives ``null`` (nothing precedes it), as OpenAI and vLLM answer.
"""

from __future__ import annotations

import codecs
import functools
import re
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


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's characters back to the bytes they stand for (GPT-2's table: printable
    bytes stand for themselves, the others for the characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The bytes token ``token_id`` stands for; ``text``: its decoding. That decoding's UTF-8
    unless it holds U+FFFD, where the token's vocabulary entry tells: a SentencePiece byte
    fallback (``<0xE6>``) or byte-level BPE's characters. Else the decoding's UTF-8."""
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback:
                return bytes([int(fallback[1], 16)])
            table = _byte_level_table()
            if piece and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
    return text.encode("utf-8")


class LogprobFormatter:
    """Formats one response's logprobs, chunk by chunk (text offsets carry on across chunks)."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self._tokenizer = tokenizer
        self._chat = chat
        self._offset = 0
        # Characters of the text so far (a character split over tokens counts once complete).
        self._chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Special tokens (a prompt's BOS) are not in the returned text: they take no offset.
        self._special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        self._pieces: dict[int, tuple[str, bytes]] = {}

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        """(the text shown for a token, its bytes): see the module docstring."""
        found = self._pieces.get(token_id)
        if found is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
                found = (text, text.encode("utf-8"))
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
                raw = token_bytes(self._tokenizer, token_id, text)
                found = (raw.decode("utf-8", errors="backslashreplace"), raw)
            self._pieces[token_id] = found
        return found

    def _text(self, token_id: int) -> str:
        return self._piece(token_id)[0]

    def format(
        self, token_ids: list[int], entries: Sequence[TokenLogprob | None] | None
    ) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice (or streamed chunk) with these tokens; None if off.

        An entry None (an echoed prompt's first token, completions only) has null logprobs.
        """
        if entries is None:
            return None
        if self._chat:
            return {
                "content": [
                    {
                        **self._chat_token(token_id, entry.logprob),
                        "top_logprobs": [self._chat_token(i, lp) for i, lp in entry.top],
                    }
                    for token_id, entry in zip(token_ids, entries, strict=True)
                    if entry is not None
                ]
            }
        texts = [self._text(t) for t in token_ids]
        offsets = []
        for token_id in token_ids:
            if token_id in self._special:
                offsets.append(self._offset)
                continue
            raw = self._piece(token_id)[1]
            pending = self._chars.getstate()[0]  # bytes of a character not complete yet
            if pending and not (raw and raw[0] & 0xC0 == 0x80):
                # The token cannot continue it: it will read as U+FFFD, before this token.
                offsets.append(self._offset + len(pending.decode("utf-8", errors="replace")))
            else:
                offsets.append(self._offset)  # (a continuation starts where its character does)
            self._offset += len(self._chars.decode(raw))
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

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self._piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}
