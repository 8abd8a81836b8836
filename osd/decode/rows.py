"""One request in the batch: its settings (osd.decode.request), slots, sequence and log data.

Per-row state lives here as plain Python (the sequence, the text assembler, the counters); the
step turns the rows of one step into flat tensors once, and writes back what it emitted once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from osd.decode import rng
from osd.decode.generation import (
    FinishReason,
    GenerationLog,
    GenerationResult,
    GenerationStats,
    StreamChunk,
    TextAssembler,
    TokenLogprob,
)
from osd.decode.goodput import GoodputController
from osd.decode.log_top_m import LoggedPositions
from osd.decode.logprobs import PromptLogprobs
from osd.decode.request import DecodeRequest

__all__ = ["Row"]


@dataclass(eq=False)
class Row:
    """A request being decoded: settings, KV slots, sequence, counters and outputs.

    Attributes:
        request: the validated settings.
        slots: its KV slots in both caches; ``slots[0]`` holds the sequence, the others are
            SpecTr branches' scratch rows for one step.
        seq: prompt and generated tokens.
        target_len, draft_len: positions of ``seq`` in each model's cache.
        step: steps taken (addresses this row's random draws, so they do not depend on the batch).
        on_chunk: called with each step's :class:`StreamChunk` (from the decoding thread).
        followers: the other choices of its prompt, until its prefill is shared with them.
    """

    request: DecodeRequest
    tokenizer: object
    slots: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    target_len: int = 0
    draft_len: int = 0
    step: int = 0
    stats: GenerationStats = field(default_factory=GenerationStats)
    # The log's data a step: drafted tokens' q (a host slice, osd.devices.on_host), and the
    # target's top ids and probabilities at each position the step emitted (its share of the
    # step's top-m, read when the log is built: osd.decode.log_top_m).
    draft_token_probs: list[np.ndarray] = field(default_factory=list)
    log_rows: list[LoggedPositions] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    on_chunk: Callable[[StreamChunk], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    first_token_at: float = 0.0  # perf_counter() of the first emitted token (0: none yet)
    # Rows of the same prompt that get this row's prefill when its prompt is complete
    # (osd.decode.choices: OpenAI's n); emptied once shared.
    followers: list[Row] = field(default_factory=list)
    # What failed this request alone during a step (e.g. its grammar); the loop ends it with it.
    error: BaseException | None = None
    # The prompt's logprobs, chunk by chunk, when the request asks (osd.decode.logprobs).
    prompt_logprobs: PromptLogprobs | None = None
    # State the proposers keep per row (osd.decode.proposers: e.g. the index of its tokens).
    scratch: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.seq = list(self.request.prompt_ids)
        self.assembler = TextAssembler(
            self.tokenizer, self.request.stop, self.request.skip_special_tokens
        )
        self.draft_key = rng.stream_key(self.request.seed, rng.DRAFT_STREAM)
        self.verify_key = rng.stream_key(self.request.seed, rng.VERIFY_STREAM)
        # The grammar's parser state after the tokens emitted so far (osd.decode.grammar_masks).
        self.matcher: Any = None if self.request.grammar is None else self.request.grammar.matcher()

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to run through the models before the row can decode."""
        return max(0, len(self.request.prompt_ids) - self.target_len)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - self.stats.num_generated

    def spec_tokens(self, controller: GoodputController | None = None, batch: int = 1) -> int:
        """Tokens to draft this step: k, less near the budget; 0 with speculation off; with
        ``auto_spec``, what the controller chooses (0 included)."""
        request = self.request
        if request.method == "none":
            return 0
        limit = min(request.num_spec_tokens, self.remaining - 1)
        if request.auto_spec and controller is not None:
            return controller.choose(self.stats_key, request.route, batch, limit)
        return max(1, limit)

    @property
    def draft_adapter(self) -> str | None:
        """The LoRA adapter of the row's draft forwards: None (the bare draft) where the adapter
        has the base draft's weights, whose LoRA adds exactly zero at the cost of its layers (at
        one row on the demo draft: 0.55 ms a forward against 0.38 ms without it)."""
        return None if self.request.base_weights else self.request.adapter

    @property
    def stats_key(self) -> str:
        """The draft whose acceptance this row measures: the adapter version, or ``base`` for
        the base draft's weights under any name. A cold replica's five untrained adapters each
        started at the controller's optimistic prior and drafted, catch-ups and all, until
        disproven one by one: at 16 greedy clients 0.85x the target alone."""
        return self.draft_adapter or "base"

    def emit(
        self,
        drafted: list[int],
        num_accepted: int,
        next_token: int,
        num_drafted: int,
        logprobs: list[TokenLogprob] | None = None,
        proposer: str = "draft",
    ) -> StreamChunk:
        """Takes a verified step: the kept drafts and the next token; returns its chunk.

        ``logprobs`` (rows that asked) has an entry per position of the step's tokens; those
        of the tokens kept go with them.
        """
        self.step += 1
        token_ids, finish = _truncate(
            [*drafted[:num_accepted], next_token], self.remaining, self.request.stop_token_ids
        )
        # A stop token's text is not the answer's (vLLM leaves it out too; end-of-sequence
        # decodes to nothing anyway): its id stays, counted in the usage, with its logprob.
        text, num_kept = self.assembler.add(token_ids[:-1] if finish == "stop" else token_ids)
        if self.assembler.stopped:
            # Tokens past a stop string leave the answer, its usage and the record alike.
            token_ids, finish = token_ids[:num_kept], "stop"
        self.seq.extend(token_ids)
        stats = self.stats
        stats.steps += 1
        stats.drafted += num_drafted
        stats.accepted += num_accepted
        stats.num_generated += len(token_ids)
        stats.count_step(proposer, num_drafted, num_accepted)
        stats.draft_lengths.append(num_drafted)
        stats.accepted_lengths.append(num_accepted)
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        stats.decode_seconds = now - self.first_token_at
        if finish is None and stats.num_generated >= self.request.max_new_tokens:
            finish = "length"
        if finish is not None:
            text += self.assembler.flush()
            self.finish_reason = finish
        kept = None if logprobs is None else logprobs[: len(token_ids)]
        prompt = self.prompt_logprobs.resolve() if self.prompt_logprobs and self.step == 1 else None
        return self._chunk(StreamChunk(token_ids, text, finish, kept, prompt))

    def _chunk(self, chunk: StreamChunk) -> StreamChunk:
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs or [])
        self.text.append(chunk.text)
        if self.on_chunk is not None:
            self.on_chunk(chunk)
        return chunk

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled.is_set()

    def result(self) -> GenerationResult:
        """The generation so far (all of it once :attr:`done`; waits for its log's last step
        where the top-m worker has not finished it: :meth:`log_pending`)."""
        return GenerationResult(
            token_ids=list(self.token_ids),
            text="".join(self.text),
            finish_reason=self.finish_reason or "length",
            stats=self.stats,
            log=self._log() if self.request.log_top_m else None,
            logprobs=None if self.request.logprobs is None else list(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else self.prompt_logprobs.entries,
        )

    def log_pending(self) -> Future | None:
        """The step whose top-m this row's log still waits for, if any (the worker takes a
        pair's steps one at a time, so only the row's last can be)."""
        return self.log_rows[-1].step.pending() if self.log_rows else None

    def _log(self) -> GenerationLog:
        """The log of the steps so far (their data came to the host with each step's sync,
        the target's top-m on a CPU from the worker of :mod:`osd.decode.log_top_m`: this waits
        for its last step where it has not landed).

        The record holds the answer's tokens and one target distribution per token: what a
        step verified past a stop string, a stop token or the budget is left out of both, so
        they stay aligned. Keeping those positions would make the training data depend on
        the method, and favour positions where the draft agreed (only a step that accepted
        past the stop reaches them). The steps' drafted and accepted counts and draft
        probabilities stay whole: they describe verification that happened, and the trainer
        skips positions past the last token (``trainer.examples.rejected_positions``).
        """
        request, num_generated = self.request, self.stats.num_generated
        top_m = self.request.log_top_m or 1
        steps = [positions.arrays() for positions in self.log_rows]
        ids = [i for i, _ in steps] or [np.zeros((0, top_m), dtype=np.int64)]
        probs = [p for _, p in steps] or [np.zeros((0, top_m), dtype=np.float32)]
        draft_probs = self.draft_token_probs or [np.zeros(0, dtype=np.float32)]
        return GenerationLog(
            request=request,
            prompt_len=len(request.prompt_ids),
            token_ids=torch.tensor(self.seq, dtype=torch.int32),
            num_drafted=torch.tensor(self.stats.draft_lengths, dtype=torch.int32),
            num_accepted=torch.tensor(self.stats.accepted_lengths, dtype=torch.int32),
            # Rounded to float16 by torch, as the records always were.
            draft_token_probs=torch.from_numpy(np.concatenate(draft_probs)).half(),
            target_top_ids=torch.from_numpy(np.concatenate(ids)[:num_generated]).int(),
            target_top_probs=torch.from_numpy(np.concatenate(probs)[:num_generated]).half(),
            step_proposers=tuple(self.stats.step_proposers),
        )


def _truncate(
    token_ids: list[int], remaining: int, stop_token_ids: frozenset[int]
) -> tuple[list[int], Literal["stop", "length"] | None]:
    """Cuts a step's tokens at the budget and after the first stop token."""
    for i, token in enumerate(token_ids[:remaining]):
        if token in stop_token_ids:
            return token_ids[: i + 1], "stop"
    return token_ids[:remaining], ("length" if len(token_ids) >= remaining else None)
