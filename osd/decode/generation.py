"""What a generation returns: tokens, text, statistics and the per-request log data.

Also the incremental detokenizer that turns verified tokens into text deltas, holding back
text that may still become a stop string or an incomplete UTF-8 character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from osd.decode.request import DecodeRequest

__all__ = [
    "FinishReason",
    "GenerationLog",
    "GenerationResult",
    "GenerationStats",
    "StreamChunk",
    "TextAssembler",
    "TokenLogprob",
    "merge_chunks",
    "text_decoder",
]

FinishReason = Literal["stop", "length"]


@dataclass
class GenerationStats:
    """Counts for one request.

    Attributes:
        steps: target verification calls (each drafts, verifies and emits >= 1 token).
        drafted: drafted tokens offered to the verifier (per chosen draft sequence for SpecTr).
        accepted: drafted tokens the verifier accepted (also past a stop string: they measure
            the draft).
        num_generated: tokens emitted (those a step verified past a stop string excluded).
        draft_lengths: tokens drafted at each step (0: the target alone, e.g. the first token).
        accepted_lengths: drafted tokens kept at each step.
        decode_seconds: wall seconds from the first token to the last (the decode part of the
            latency: what speculation changes; queueing and prefill come before it).
        by_proposer: per proposer that drafted (``draft``, ``suffix``, ``ngram``): steps,
            tokens drafted, tokens accepted (osd.decode.proposers).
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    num_generated: int = 0
    draft_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0
    by_proposer: dict[str, list[int]] = field(default_factory=dict)
    step_proposers: list[str] = field(default_factory=list)

    def count_step(self, proposer: str, num_drafted: int, num_accepted: int) -> None:
        """One step's draft under its proposer (``by_proposer`` counts steps that drafted)."""
        self.step_proposers.append(proposer)
        if num_drafted:
            counts = self.by_proposer.setdefault(proposer, [0, 0, 0])
            counts[0] += 1
            counts[1] += num_drafted
            counts[2] += num_accepted

    def proposer_mix(self) -> dict[str, dict[str, int]]:
        """``by_proposer`` as named counts (the response's ``osd`` block)."""
        return {
            name: {"steps": c[0], "drafted": c[1], "accepted": c[2]}
            for name, c in sorted(self.by_proposer.items())
        }

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens kept."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per target call."""
        return self.num_generated / self.steps if self.steps else 0.0

    @property
    def mean_draft_length(self) -> float:
        """Tokens drafted per step after the first (whose token the prefill's target gives)."""
        decode = self.draft_lengths[1:]
        return sum(decode) / len(decode) if decode else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "num_generated": self.num_generated,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_step": self.tokens_per_step,
            "mean_draft_length": self.mean_draft_length,
            "decode_seconds": self.decode_seconds,
        }


@dataclass
class GenerationLog:
    """What the target thought, per request: the trainer's input (docs/design.md, "Record").

    Attributes:
        request: the request's settings as validated at the edge (:mod:`osd.decode.request`).
        prompt_len: number of prompt tokens at the start of ``token_ids``.
        token_ids: (prompt_len + N,) int32 prompt then generated tokens.
        num_drafted: (S,) int32 tokens drafted per verification step.
        num_accepted: (S,) int32 drafted tokens kept per step.
        draft_token_probs: (sum(num_drafted),) float16 draft probability of each drafted token.
        target_top_ids: (N, m) int32 target's top-m tokens at each generated position.
        target_top_probs: (N, m) float16 their probabilities at temperature 1.
        step_proposers: (S,) who drafted each step (``draft``, ``suffix``, ``ngram``).
    """

    request: DecodeRequest
    prompt_len: int
    token_ids: torch.Tensor
    num_drafted: torch.Tensor
    num_accepted: torch.Tensor
    draft_token_probs: torch.Tensor
    target_top_ids: torch.Tensor
    target_top_probs: torch.Tensor
    # Who drafted each step (osd.decode.methods.PROPOSERS).
    step_proposers: tuple[str, ...] = ()


@dataclass
class TokenLogprob:
    """An emitted token's log probability and the most likely tokens at its position.

    From the target's raw distribution (log-softmax of its logits before temperature,
    penalties, bias and truncation; see :mod:`osd.decode.logprobs`).

    Attributes:
        logprob: the emitted token's.
        top: up to the requested number of (token id, logprob), most likely first.
    """

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class StreamChunk:
    """Tokens verified in one step and the text they add (may be empty while held back).

    ``logprobs``, when the request asked for them, has one entry per token of ``token_ids``.
    ``prompt_logprobs``, in a row's first chunk when the request asked for them, has one per
    prompt token (the first None: nothing precedes it).
    """

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class GenerationResult:
    """A finished generation.

    Attributes:
        token_ids: generated tokens (the prompt excluded), up to the one that ended generation:
            a stop token, or the token that completed a stop string (tokens a speculative step
            verified past it are dropped, so the count does not depend on the method).
        text: their decoded text, cut before a stop string if one was hit.
        finish_reason: ``"stop"`` (end of sequence or a stop string) or ``"length"``.
        stats: speculative decoding counts.
        log: per-request log data; None when logging was not requested.
        logprobs: one entry per token of ``token_ids`` when the request asked for them.
        prompt_logprobs: one entry per prompt token when the request asked for them (the
            first None, as OpenAI's echo and vLLM's prompt_logprobs give it).
    """

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    log: GenerationLog | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class TextAssembler:
    """Decodes generated tokens incrementally and finds stop strings.

    Text that could still be the start of a stop string, or ends in an incomplete UTF-8
    sequence, is held back until the next tokens settle it.
    """

    # Decoding is incremental (as vLLM's detokenizer is): each step decodes a window of recent
    # tokens, not the whole generation (a full decode costs 22 us at 64 tokens and 297 us at
    # 1,024 with the demo tokenizer, per row and step). The window starts at ``_prefix``; the
    # text of the first ``_read`` tokens is ``_settled``, and ``_window_base`` is the window's
    # own decode up to ``_read``: what a longer window decodes to past that base is new text
    # (starting both decodes at the same token cancels a tokenizer's start-of-text handling).
    # The window restarts nearer the end once it holds _WINDOW tokens.
    _WINDOW = 32
    _KEEP = 6  # tokens before the read point a restarted window keeps as context

    def __init__(
        self, tokenizer: Any, stop: Sequence[str], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_ids = text_decoder(tokenizer, skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._token_ids: list[int] = []
        self._emitted = 0
        self._prefix = 0
        self._read = 0
        self._settled = ""
        self._window_base = ""
        self._last_window: tuple[int, int, str] | None = None  # (prefix, end, its text)
        self.text = ""
        self.stopped = False

    def add(self, token_ids: list[int]) -> tuple[str, int]:
        """Adds tokens; returns the text now safe to emit and how many of the tokens it keeps.

        A stop string sets ``stopped`` and keeps the tokens up to the one that completed it:
        speculation emits several tokens a step, and those after the stop string were never
        part of the answer (one token at a time, generation would have ended before them).
        Decoding is taken as prefix-stable: the text of fewer tokens begins the text of more.
        """
        if self._tokenizer is None:
            return "", len(token_ids)
        start = len(self._token_ids)
        self._token_ids.extend(token_ids)
        full = self._decode(len(self._token_ids))
        cut = self._find_stop(full)
        if cut >= 0:
            # The first of the added tokens at which a stop string is in the text.
            for end in range(start + 1, len(self._token_ids)):
                prefix = self._decode(end)
                if (prefix_cut := self._find_stop(prefix)) >= 0:
                    full, cut = prefix, prefix_cut
                    del self._token_ids[end:]
                    break
            self.stopped, full = True, full[:cut]
            safe = len(full)
        else:
            safe = len(full) - self._held_back(full)
            if not full.endswith("\ufffd"):  # settled: no character is waiting for bytes
                self._settle(full)
        self.text = full
        delta = full[self._emitted : max(safe, self._emitted)]
        self._emitted = max(safe, self._emitted)
        return delta, len(self._token_ids) - start

    def _decode(self, num_tokens: int) -> str:
        """The text of the first ``num_tokens`` tokens (at least the settled ones)."""
        if num_tokens == self._read:
            return self._settled
        window = self._decode_ids(self._token_ids[self._prefix : num_tokens])
        self._last_window = (self._prefix, num_tokens, window)
        if window.startswith(self._window_base):
            return self._settled + window[len(self._window_base) :]
        return self._decode_ids(self._token_ids[:num_tokens])  # not prefix-stable here

    def _settle(self, full: str) -> None:
        """Marks every token's text as settled (``full``), restarting a long window."""
        end = len(self._token_ids)
        if end - self._prefix > self._WINDOW:
            self._prefix = max(end - self._KEEP, 0)
        last = self._last_window
        if last is not None and last[:2] == (self._prefix, end):
            self._window_base = last[2]  # this step's decode already
        else:
            self._window_base = self._decode_ids(self._token_ids[self._prefix : end])
        self._read, self._settled = end, full

    def _find_stop(self, text: str) -> int:
        """Where the earliest stop string begins in ``text``; -1 if none is in it."""
        return min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)

    def flush(self) -> str:
        """Returns whatever is still held back (at the end of generation)."""
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may still change: a character waiting for
        its last bytes, and before it whatever could begin a stop string (the character being
        completed may be the stop string's next one)."""
        partial = len(text) - len(text.rstrip("\ufffd"))
        body = text[: len(text) - partial]
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(body)), longest, -1):
                if body.endswith(stop[:size]):
                    longest = size
                    break
        return partial + longest


def text_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=...)``, as one call into the Rust backend
    where that is all a fast tokenizer's decode does (a third of its cost: transformers' wrapper
    checks and converts its arguments on every call, and a row decodes every step)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is None
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
        or type(tokenizer).decode is not PreTrainedTokenizerBase.decode
        or type(tokenizer)._decode is not TokenizersBackend._decode
    ):
        return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
    return lambda ids: str(backend.decode(ids, skip_special_tokens=skip_special_tokens))


def merge_chunks(chunks: list[StreamChunk]) -> StreamChunk:
    """Consecutive steps' chunks as one (a consumer that fell behind takes them together)."""
    if len(chunks) == 1:
        return chunks[0]
    return StreamChunk(
        [token for chunk in chunks for token in chunk.token_ids],
        "".join(chunk.text for chunk in chunks),
        chunks[-1].finish_reason,
        None if chunks[0].logprobs is None else [e for c in chunks for e in c.logprobs or []],
        chunks[0].prompt_logprobs,
    )
