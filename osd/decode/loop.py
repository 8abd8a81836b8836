"""One decode loop per replica: continuous batching at step granularity.

A background thread owns both models' slot caches. Each turn it takes new submissions,
drops cancelled requests, admits waiting ones while there is room (:mod:`osd.decode.scheduler`),
prefills up to ``max_num_batched_tokens`` prompt tokens of the joiners, and runs one
speculative step (:func:`osd.decode.step.run_step`) over every request that is decoding. One
joiner a turn with a short prompt (``_RIDER_LEAST_TOKENS`` to ``_RIDER_TOKENS``, no other
choices, one draft, no prompt logprobs) rides in that step instead, where the target's forward
packs (:attr:`osd.decode.models.CausalLM.packs`): its prompt goes through the step's target
forward beside the other rows' tokens, its attention on a grid of its own
(:func:`osd.decode.kv_cache.attention_split`), drafting nothing, and its first token comes from
the same draw as after a prefill of its own (``BatchLimits.fuse_prefill``, off by default).
Rows that finish apart (speculation makes them) then take no prefill forward of a row or two
each to replace:
the prompt's tokens cost what they cost, the forward's fixed cost is shared
(``docs/benchmarks.md``). A request leaves the batch the step it finishes, hits a stop, or is
cancelled, and its slots go to the next waiting request at once; a hole no joiner fills takes
the row in the highest slot, moved down (the batch stays in consecutive slots, which read their
keys in place: ``BatchedEngine._condense``). Callers get a
:class:`RequestHandle`: an iterator of the request's chunks that blocks until the loop
produces them, or a handle that hands them to a sink from the loop's thread (a consumer on
an event loop: no thread waits per request).

Several choices of one prompt (OpenAI's ``n``) come in as a group (:meth:`BatchedEngine.
submit_group`, requests from :func:`osd.decode.choices.choice_requests`): the group waits, is
admitted and is cancelled as a whole until its prompt is prefilled, once, by its first choice
(the leader, the only one of the group in ``_prefilling``); the others (followers) then get the
prompt's KV copied into their own slots (:func:`osd.decode.choices.share_prompt`) and decode as
independent rows. A group counts once towards ``max_waiting`` (it is one client request) and
as its number of rows towards ``max_num_seqs`` and the KV slots.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from osd.decode.choices import check_group
from osd.decode.generation import GenerationResult, StreamChunk
from osd.decode.goodput import GoodputController
from osd.decode.limits import HTTP_MAX_DRAFTS, MAX_SPEC_TOKENS
from osd.decode.prefix_reuse import SlotContents, common_prefix
from osd.decode.request import DecodeRequest
from osd.decode.request_checks import fitted_budget
from osd.decode.rows import Row
from osd.decode.scheduler import BatchLimits, kv_slots_for_memory, num_to_admit
from osd.decode.step import prefill, run_step
from osd.errors import ParamError
from osd.threads import usable_cores

if TYPE_CHECKING:
    from osd.decode.engine import SpeculativeDecoder

__all__ = [
    "BatchedEngine",
    "EngineFull",
    "LoopStats",
    "RequestHandle",
]

log = logging.getLogger(__name__)

_END = object()
# The most prompt tokens that ride in a decode step (BatchedEngine._riders): a longer prompt's
# own compute dwarfs the forward riding saves, and it would slow every row's step.
_RIDER_TOKENS = 256
# The fewest: a shorter one leaves its own attention grid under two columns
# (osd.decode.kv_cache.attention_split), and its own prefill costs little.
_RIDER_LEAST_TOKENS = 4


class EngineFull(RuntimeError):
    """The loop's waiting queue is full; retry later (HTTP 429/503)."""


class RequestHandle:
    """A submitted request: iterate for its chunks (blocking), or hand them to a sink
    (:meth:`deliver_to`); :meth:`cancel`, :meth:`result`.

    Safe to cancel from any thread; iterate it from one.
    """

    def __init__(self, row: Row, wake: threading.Event) -> None:
        self._row = row
        self._wake = wake
        self._chunks: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._ended = False
        self._followers: list[RequestHandle] = []  # a group's other choices, until prefilled
        self._sink: Callable[[StreamChunk | None], None] | None = None
        self._sink_lock = threading.Lock()
        row.on_chunk = self._put

    @property
    def request(self) -> DecodeRequest:
        return self._row.request

    def deliver_to(self, sink: Callable[[StreamChunk | None], None]) -> None:
        """Hands each step's chunk to ``sink`` from the decoding thread, then ``None`` once the
        request ended (:meth:`result` then answers at once), instead of queueing them for an
        iterating thread: a consumer on an event loop needs no thread waiting on the queue.
        Where the log's last step is still with the top-m worker (on a CPU,
        :mod:`osd.decode.log_top_m`), ``None`` comes from that worker's thread once it landed,
        so the decoding thread never waits for it. Chunks already queued are handed first, in
        order. Call it once, and do not iterate."""
        with self._sink_lock:
            if self._sink is not None:
                raise RuntimeError("the handle already delivers to a sink")
            while not self._chunks.empty():
                self._hand(sink, self._chunks.get_nowait())
            self._sink = sink

    def _put(self, item: object) -> None:
        """From the decoding thread: a chunk, or the end."""
        with self._sink_lock:
            if self._sink is None:
                self._chunks.put(item)
            else:
                self._hand(self._sink, item)

    def _hand(self, sink: Callable[[StreamChunk | None], None], item: object) -> None:
        if item is _END:
            self._ended = True
            pending = self._row.log_pending()
            if pending is None:
                sink(None)
            else:  # the log's last step is with the top-m worker: the end goes from there
                pending.add_done_callback(lambda _: sink(None))
        else:
            assert isinstance(item, StreamChunk)
            sink(item)

    def __iter__(self) -> RequestHandle:
        return self

    def __next__(self) -> StreamChunk:
        if self._ended:
            raise StopIteration
        item = self._chunks.get()
        if item is _END:
            self._ended = True
            if self._error is not None:
                raise self._error
            raise StopIteration
        assert isinstance(item, StreamChunk)
        return item

    def cancel(self) -> None:
        """Frees the request's row at the next step boundary; the stream then ends."""
        self._row.cancelled.set()
        self._wake.set()

    def result(self) -> GenerationResult:
        """Waits for the end of the request (at once once a sink got the end); raises what
        failed it, if anything did."""
        if self._sink is None:
            for _ in self:
                pass
        elif not self._ended:
            raise RuntimeError("the request has not ended: its sink gets None when it does")
        if self._error is not None:
            raise self._error
        return self._row.result()

    def _close(self, error: BaseException | None = None) -> None:
        self._error = error
        self._put(_END)

    @property
    def _group_cancelled(self) -> bool:
        """Whether every choice of its group (itself, until prefilled) was cancelled."""
        return all(h._row.cancelled.is_set() for h in (self, *self._followers))

    @property
    def _group_size(self) -> int:
        return 1 + len(self._followers)


@dataclass
class LoopStats:
    """Counters of the loop, for metrics and benchmarks (read without a lock: approximate)."""

    steps: int = 0
    rows_stepped: int = 0  # sum over steps of the batch size
    step_seconds: float = 0.0
    waiting: int = 0
    running: int = 0
    riders: int = 0  # prompts read in a decode step's forward, not one of their own
    moved: int = 0  # rows moved down into a free slot (BatchedEngine._condense)
    # Prompt tokens of admitted requests, and those of them copied from another slot's KV
    # rather than prefilled (osd.decode.prefix_reuse; vLLM's prefix cache queries and hits).
    prompt_tokens: int = 0
    reused_tokens: int = 0

    @property
    def mean_batch(self) -> float:
        return self.rows_stepped / self.steps if self.steps else 0.0


class BatchedEngine:
    """Decodes every submitted request in one loop thread, batched at each step.

    Args:
        decoder: the validated model pair (its draft's LoRA adapters serve the rows).
        limits: capacity; see :class:`BatchLimits`.
        num_threads: torch intra-op threads of the loop; None: the cores this process may use.
    """

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        limits: BatchLimits | None = None,
        *,
        num_threads: int | None = None,
    ) -> None:
        self.decoder = decoder
        self.num_threads = num_threads or usable_cores()
        self.limits = limits = limits or BatchLimits()
        max_len = decoder.max_context or 0
        if limits.max_model_len:
            max_len = min(max_len, limits.max_model_len) if max_len else limits.max_model_len
        if not max_len:
            raise ValueError("the models declare no context length: set max_model_len")
        self.max_len = max_len
        # The most tokens a row sends the target in one forward: a prefill chunk or a verified
        # block; the target's windowed layers keep their window and this much (kv_cache).
        max_forward = min(max(limits.max_num_batched_tokens, MAX_SPEC_TOKENS + 1), max_len)
        # Slots sized to a memory budget: the caches take it whole at their first forward
        # (the warm-up's), not by doubling while serving.
        budgeted = not limits.kv_slots and limits.kv_cache_memory_bytes > 0
        if budgeted:
            per_slot = decoder.target.kv_bytes_per_slot(max_len, max_forward)
            per_slot += decoder.draft.kv_bytes_per_slot(max_len)
            slots = kv_slots_for_memory(
                limits.kv_cache_memory_bytes,
                per_slot,
                max_slots=limits.max_num_seqs * HTTP_MAX_DRAFTS,
            )
            self.limits = limits = dataclasses.replace(limits, kv_slots=slots)
        # The loop's own controller: its step costs are those of this batch, not of a caller's.
        self.controller = GoodputController(max_k=decoder.max_spec_tokens)
        self.pair = decoder.model_pair(
            limits.num_slots, max_len, self.controller, max_forward, whole=budgeted
        )
        self.stats = LoopStats()
        self._free_slots = list(range(limits.num_slots))
        # What free slots' target KV still holds, for prompts that begin alike (None: off).
        self._contents: SlotContents | None = None
        self.reuse_prefixes(True)
        self._submitted: queue.SimpleQueue[RequestHandle] = queue.SimpleQueue()
        self._waiting: deque[RequestHandle] = deque()
        self._prefilling: list[RequestHandle] = []
        self._decoding: list[RequestHandle] = []
        self._count_lock = threading.Lock()  # also orders submit() against the loop's exit
        self._num_queued = 0  # groups submitted and not yet admitted
        self._closed = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="osd-decode-loop", daemon=True)
        self._thread.start()

    def submit(self, request: DecodeRequest) -> RequestHandle:
        """Queues a validated request (:meth:`SpeculativeDecoder.prepare`); never blocks.

        Raises:
            ValueError: the request can never fit (too long, or more drafts than slots).
            EngineFull: too many requests are waiting already.
        """
        return self.submit_group([request])[0]

    def submit_group(self, requests: list[DecodeRequest]) -> list[RequestHandle]:
        """Queues the choices of one prompt (:func:`osd.decode.choices.choice_requests`), whose
        prompt is prefilled once for all; never blocks.

        Returns:
            One handle per request, in order; each choice streams, ends and may be cancelled
            on its own (before the prefill, the group leaves only when all are cancelled).

        Raises:
            ValueError: the requests differ in more than their seed, or can never fit.
            EngineFull: too many requests are waiting already.
        """
        check_group(requests)
        request, num_rows = requests[0], len(requests)
        if request.num_slots * num_rows > self.limits.num_slots:
            what = f"n = {num_rows} choices of " if num_rows > 1 else ""
            raise ParamError(
                "n" if num_rows > 1 else "num_drafts",
                f"{what}num_drafts {request.num_slots} needs more KV slots than this engine has "
                f"({self.limits.num_slots})",
            )
        if num_rows > self.limits.max_num_seqs:
            raise ParamError(
                "n",
                f"n = {num_rows} choices need {num_rows} rows; this engine decodes "
                f"{self.limits.max_num_seqs} at once",
            )
        budget = fitted_budget(
            len(request.prompt_ids), request.max_new_tokens, self.max_len, request.fit_context
        )
        if budget < request.max_new_tokens:
            requests = [dataclasses.replace(r, max_new_tokens=budget) for r in requests]
        handles = [RequestHandle(Row(r, self.decoder.tokenizer), self._wake) for r in requests]
        handle = handles[0]
        handle._followers = handles[1:]
        handle._row.followers = [h._row for h in handles[1:]]
        with self._count_lock:
            if self._closed or self._stop.is_set():
                raise RuntimeError("the engine is closed")
            if self._num_queued >= self.limits.max_waiting:
                raise EngineFull(f"{self._num_queued} requests are waiting; retry shortly")
            self._num_queued += 1
            self._submitted.put(handle)  # under the lock: the loop's exit drains after it
        self._wake.set()
        return handles

    def reuse_prefixes(self, on: bool) -> None:
        """Turns prefix caching on (where ``BatchLimits.prefix_caching`` and the target's
        cache allow it) or off; either way what free slots held is forgotten. The warm-up
        turns it off while it runs: its rounds repeat their prompts, and their prefills must
        run whole to warm what served prompts run. Call it while no request is in the loop."""
        allowed = self.limits.prefix_caching and not self.pair.target_cache.has_rings
        self._contents = SlotContents() if on and allowed else None

    @property
    def alive(self) -> bool:
        """Whether the decode loop runs (it stops only when closed, or on a bug)."""
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stops the loop; requests still in it end with an error."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        # The loop thread is the process's one thread that runs torch in parallel; its OpenMP
        # team is its own (the count is per thread). Measured on 2 cores: a second thread with a
        # parallel team of its own (e.g. the main thread after a matmul) made the loop's forwards
        # about 2x slower; helper threads therefore run torch single-threaded.
        torch.set_num_threads(self.num_threads)
        while not self._stop.is_set():
            try:
                self._turn()
            except BaseException as exc:  # noqa: BLE001 - the loop must outlive any request
                log.exception("decode loop turn failed")
                self._fail(self._prefilling + self._decoding, exc)
                self._prefilling, self._decoding = [], []
                if self._contents is not None:  # a copy may have stopped halfway
                    self._contents = SlotContents()
        error = RuntimeError("the engine was closed")
        with self._count_lock:
            self._closed = True  # no submit() gets past this; all earlier ones are queued
        self._fail(self._prefilling + self._decoding + list(self._waiting), error)
        while not self._submitted.empty():
            self._fail([self._submitted.get()], error)

    def _turn(self) -> None:
        busy = self._prefilling or self._decoding
        if not busy:
            self._wake.wait(timeout=0.5)
        self._wake.clear()
        while not self._submitted.empty():
            self._waiting.append(self._submitted.get())
        self._drop_cancelled()
        self._admit()
        riders = self._riders()
        if self._prefilling:
            self._prefill(sum(h._row.prefill_left for h in riders))
        if self._decoding or riders:
            self._step(riders)
        self.stats.waiting = sum(h._group_size for h in self._waiting)
        self.stats.running = self._num_running()

    def _num_running(self) -> int:
        return sum(h._group_size for h in self._prefilling) + len(self._decoding)

    def _drop_cancelled(self) -> None:
        for handle in [h for h in self._decoding if h._row.cancelled.is_set()]:
            self._decoding.remove(handle)
            self._release(handle)
        for handle in [h for h in self._prefilling if h._group_cancelled]:
            self._prefilling.remove(handle)
            self._release(handle)
        for handle in [h for h in self._waiting if h._group_cancelled]:
            self._waiting.remove(handle)
            self._dequeued(1)
            self._release(handle)  # it holds no slots yet: this closes its group

    def _admit(self) -> None:
        # A group joins whole or waits (its followers need their slots when its prompt is done).
        groups = [[h, *h._followers] for h in self._waiting]
        count = num_to_admit(
            [h.request.num_slots for group in groups for h in group],
            num_running=self._num_running(),
            free_slots=len(self._free_slots),
            max_num_seqs=self.limits.max_num_seqs,
        )
        # Lowest slots first, and the decoding rows kept in slot order: a batch in consecutive
        # slots reads its keys in place (osd.decode.kv_cache, ForwardPlan.first_slot).
        self._free_slots.sort()
        live = self._decoding + self._prefilling  # before the joiners: their KV is to come
        joiners: list[RequestHandle] = []
        for group in groups:
            if len(group) > count:
                break
            count -= len(group)
            for handle in group:
                needed = handle.request.num_slots
                handle._row.slots = self._free_slots[:needed]
                del self._free_slots[:needed]
            joiners.append(self._waiting.popleft())
        self._prefilling += joiners
        self._dequeued(len(joiners))
        self.stats.prompt_tokens += sum(len(h.request.prompt_ids) for h in joiners)
        if joiners and self._contents is not None:
            self._reuse_prefixes(self._contents, joiners, live)

    def _reuse_prefixes(
        self, contents: SlotContents, joiners: list[RequestHandle], live: list[RequestHandle]
    ) -> None:
        """Starts each joining prompt past the beginning it shares with a row still in the
        batch or a free slot's last row: those positions' target KV is copied into its slot
        (:mod:`osd.decode.prefix_reuse`). Not for prompts whose logprobs are asked for (every
        position's logits come from their own prefill)."""
        slots = [slot for h in joiners for m in (h, *h._followers) for slot in m._row.slots]
        held = contents.take(slots)
        # What the joiners' slots held goes to other free slots, unless the joiner's own prompt
        # begins with all of it (its slot will hold it again).
        prompts = {h._row.slots[0]: np.asarray(h.request.prompt_ids) for h in joiners}
        lost = {
            slot: tokens
            for slot, tokens in held.items()
            if slot not in prompts or common_prefix(prompts[slot], tokens) < len(tokens)
        }
        self.pair.copy_prefixes(contents.preserve(lost, self._free_slots))
        sources = [
            (h._row.slots[0], h._row.seq[: h._row.target_len])
            for h in live
            if h._row.slots and h._row.target_len
        ]
        copies: list[tuple[int, int, int]] = []
        for handle in joiners:
            row = handle._row
            if row.request.prompt_logprobs is not None:
                continue
            own = row.slots[0]
            source, shared = contents.best(row.request.prompt_ids, (own, held.get(own)), sources)
            if shared:
                if source != own:
                    copies.append((source, own, shared))
                row.target_len = shared
                self.stats.reused_tokens += shared
        self.pair.copy_prefixes(copies)

    def _dequeued(self, count: int) -> None:
        with self._count_lock:
            self._num_queued -= count

    def _riders(self) -> list[RequestHandle]:
        """The joiner whose prompt rides in this turn's decode step (module docstring), taken
        out of ``_prefilling``; none when no row decodes (a prefill is then the only forward),
        or where the target's forward cannot keep the prompt's attention apart from the other
        rows' (it does not pack: :attr:`osd.decode.models.CausalLM.packs`). One a turn: the
        target's compiled graph for a step with a prompt in it takes one."""
        if not self._decoding or not self.limits.fuse_prefill or not self.pair.target.packs:
            return []
        budget = min(self.limits.max_num_batched_tokens, _RIDER_TOKENS)
        for handle in self._prefilling:
            row, request = handle._row, handle.request
            alone = not handle._followers and request.num_slots == 1
            size = row.prefill_left
            if alone and request.prompt_logprobs is None and _RIDER_LEAST_TOKENS <= size <= budget:
                self._prefilling.remove(handle)
                return [handle]
        return []

    def _prefill(self, riding: int = 0) -> None:
        """Prefills the joiners that do not ride, with what ``riding`` tokens leave of the
        per-turn budget."""
        rows = [h._row for h in self._prefilling]
        try:
            prefill(self.pair, rows, max(self.limits.max_num_batched_tokens - riding, 0))
        except Exception as exc:  # noqa: BLE001 - these requests fail, others go on
            log.exception("prefill failed")
            self._fail(self._prefilling, exc)
            self._prefilling = []
            return
        self._prefilling = self._drop_failed(self._prefilling)
        ready = [h for h in self._prefilling if h._row.prefill_left <= 0]
        self._prefilling = [h for h in self._prefilling if h._row.prefill_left > 0]
        for leader in ready:  # their first tokens came with the prefill, the followers' too
            group = [leader, *leader._followers]
            leader._followers = []
            for handle in group:
                if handle._row.error is not None or handle._row.done:
                    self._release(handle, handle._row.error)
                else:
                    self._decoding.append(handle)
        if ready:
            self._decoding.sort(key=lambda h: h._row.slots[0])

    def _step(self, riders: list[RequestHandle]) -> None:
        if riders:  # in slot order with the others (their keys read in place)
            self.stats.riders += len(riders)
            self._decoding = sorted(self._decoding + riders, key=lambda h: h._row.slots[0])
        self._condense()
        rows = [h._row for h in self._decoding]
        started = time.perf_counter()
        try:
            run_step(self.pair, rows)
        except Exception as exc:  # noqa: BLE001 - these requests fail, the loop goes on
            log.exception("decode step failed")
            self._fail(self._decoding, exc)
            self._decoding = []
            return
        self._decoding = self._drop_failed(self._decoding)
        stats = self.stats
        stats.steps += 1
        stats.rows_stepped += len(rows)
        stats.step_seconds += time.perf_counter() - started
        finished = [h for h in self._decoding if h._row.done]
        if finished:
            self._decoding = [h for h in self._decoding if not h._row.done]
            for handle in finished:
                self._release(handle)

    def _condense(self) -> None:
        """Moves the decoding rows in the highest slots down into free slots below them, so
        the batch stays in consecutive slots: only such a batch reads its keys in place and
        runs the compiled layers (:mod:`osd.decode.kv_cache`); a batch with a hole gathers
        every layer's keys, eagerly. A row that finished in the middle of the batch left one
        until a joiner took its slot: at 16 sampled clients such steps cost 1.5-2x a step and
        were 2.5-4 % of the decode time, under speculation most (its rows finish apart). One
        copy of the moved rows' cached positions instead (vLLM's ``InputBatch.condense``).
        Joiners are admitted first: a hole they fill moves nothing."""
        if not self._decoding or not self._free_slots:
            return
        if min(self._free_slots) > self._decoding[-1]._row.slots[0]:
            return  # no hole below the highest row: the steady state, checked each step
        free = sorted(self._free_slots)
        moves: list[tuple[Row, int]] = []
        # Decoding rows are kept in slot order; the highest moves into the lowest hole.
        for handle in reversed(self._decoding):
            row = handle._row
            if not free or free[0] > row.slots[0] or len(row.slots) != 1:
                break
            moves.append((row, free[0]))
            free = sorted([*free[1:], row.slots[0]])
        if not moves:
            return
        contents = self._contents
        if contents is None:
            self.pair.move_rows(moves)
        else:  # a moved row's old slot still holds what it had
            left = [(row.slots[0], row.seq[: row.target_len]) for row, _ in moves]
            contents.take(dst for _, dst in moves)  # before the copy: a failed one leaves none
            self.pair.move_rows(moves)
            for slot, tokens in left:
                if slot in free:
                    contents.keep(slot, tokens)
        self._free_slots = free
        self._decoding.sort(key=lambda h: h._row.slots[0])
        self.stats.moved += len(moves)

    def _drop_failed(self, handles: list[RequestHandle]) -> list[RequestHandle]:
        """Ends the requests a step failed alone (``Row.error``); returns the others."""
        failed = [h for h in handles if h._row.error is not None]
        for handle in failed:
            self._release(handle, handle._row.error)
        return [h for h in handles if h._row.error is None] if failed else handles

    def _release(self, handle: RequestHandle, error: BaseException | None = None) -> None:
        """Frees a handle's slots and ends its stream, with its followers not yet prefilled."""
        for member in (handle, *handle._followers):
            row = member._row
            if self._contents is not None and row.slots and error is None and row.error is None:
                self._contents.keep(row.slots[0], row.seq[: row.target_len])
            self._free_slots.extend(row.slots)
            member._row.slots = []
            member._close(error)
        handle._followers = []

    def _fail(self, handles: list[RequestHandle], error: BaseException) -> None:
        for handle in handles:
            self._release(handle, error)
