"""An admitted request (:class:`Job`) and the delivery of its choices to the event loop.

A job holds one :class:`osd.decode.loop.RequestHandle` per choice (OpenAI's ``n``,
:mod:`osd.decode.choices`). Each handle hands its chunks to the job straight from the decoding
thread (:meth:`RequestHandle.deliver_to`), which posts them to the event loop: two hand-offs from
the decode thread to the SSE writer (the loop's mailbox, then the stream's asyncio queue), and no
thread waiting per choice. What one step hands the loop for every stream arrives in one
callback. The job ends itself once: when every choice ended (or one failed, or it was given back
before it started) it calls its ``on_finish`` with the results (or None), on the event loop,
whether or not anyone still reads it. A streamed choice's steps are gathered over the stream
interval in the decoding thread (a step held back neither wakes the loop nor is queued), and
steps that queued up while the consumer was busy go out as one chunk.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from osd.decode.generation import GenerationResult, StreamChunk, merge_chunks
from osd.decode.loop import RequestHandle
from serving.adapter_slots import AdapterLease
from serving.protocol import ChatRequest, CompletionRequest, new_id
from serving.router import RouteDecision
from serving.tools import ToolPlan

__all__ = ["Job"]

OnFinish = Callable[["Job", "list[GenerationResult] | None"], None]
Interval = float | Callable[[], float]
# What a choice's delivery brings to the event loop: (choice index, chunk | result | error).
_Event = tuple[int, Any]


@dataclass
class Job:
    """One admitted request: its choices' handles, route and adapter lease.

    Attributes:
        on_finish: called once on the event loop when the job ends (results, or None when it
            failed or was given back); the runtime's accounting.
    """

    request: CompletionRequest | ChatRequest
    streams: list[RequestHandle]  # one per choice (OpenAI's n), in order
    route: RouteDecision
    lease: AdapterLease
    on_finish: OnFinish | None = None
    request_id: str = field(default_factory=lambda: new_id("req"))
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    tools: ToolPlan | None = None  # its replies are read for tool calls
    finished: bool = False  # on_finish was called (exactly once)
    _queue: asyncio.Queue[_Event] | None = field(default=None, repr=False)
    _results: dict[int, GenerationResult] = field(default_factory=dict, repr=False)
    _done: asyncio.Future[list[GenerationResult]] | None = field(default=None, repr=False)
    # Streamed: the gathering interval (seconds; a callable: read at each step).
    _interval: Interval = field(default=0.0, repr=False)

    @property
    def stream(self) -> RequestHandle:
        """The first choice's handle (its request has the settings all choices share)."""
        return self.streams[0]

    @property
    def streamed(self) -> bool:
        """It delivers each step to :meth:`chunks` (``deliver(stream=True)``)."""
        return self._queue is not None

    @property
    def delivering(self) -> bool:
        """Its choices deliver to the event loop (then they end it; see :meth:`give_back`)."""
        return self._done is not None

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()

    def results(self) -> list[GenerationResult]:
        """Every choice's result, once all delivered their end."""
        return [self._results[i] for i in range(len(self.streams))]

    def finish(self, results: list[GenerationResult] | None) -> None:
        """Ends the job once (on the event loop): ``on_finish``, then nothing."""
        if self.finished:
            return
        self.finished = True
        if self.on_finish is not None:
            self.on_finish(self, results)

    def give_back(self) -> None:
        """A job whose response ended before its choices delivered: cancel and end it now
        (one that delivers ends itself when its choices do)."""
        if not self.delivering:
            self.cancel()
            self.finish(None)

    def deliver(
        self, stream: bool, interval: Interval = 0.0
    ) -> asyncio.Future[list[GenerationResult]]:
        """Starts delivery to the running event loop; returns the future of every choice's
        result. ``stream``: each step's chunk is queued for :meth:`chunks`, gathered over
        ``interval`` (seconds, or a callable read as steps arrive: a step that comes less
        than that after its choice's last event waits for the choice's next step; a
        choice's last chunk, its result and an error go at once); otherwise only the first
        chunk (the time to first token) and the ends reach the loop."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self._queue = asyncio.Queue() if stream else None
        self._interval = interval
        for index, handle in enumerate(self.streams):
            handle.deliver_to(self._sink(loop, index, handle, stream))
        return self._done

    def _sink(
        self, loop: asyncio.AbstractEventLoop, index: int, handle: RequestHandle, stream: bool
    ) -> Callable[[StreamChunk | None], None]:
        """The choice's sink, called in the decoding thread (the end may come from the log's
        top-m worker: osd.decode.loop.RequestHandle.deliver_to; one choice's calls never overlap).
        A streamed step within the interval of its choice's last event is held here: it
        reaches the event loop with a later step, so it wakes nothing (a step's chunks for
        every row once woke the loop once each)."""
        mailbox = _Mailbox.of(loop)
        held: list[StreamChunk] = []
        sent: float | None = None  # when the choice's last chunk went to the loop

        def sink(chunk: StreamChunk | None) -> None:
            nonlocal sent
            item: Any = chunk
            if chunk is None:
                try:
                    item = handle.result()  # ended: answers at once
                except BaseException as exc:  # noqa: BLE001 - handed to the event loop
                    item = exc
                if held and isinstance(item, GenerationResult):  # what waited, then the end
                    mailbox.post(self._arrive, index, merge_chunks(held))
                held.clear()
            elif not stream:
                if sent is not None:
                    return  # a whole answer's loop hears of its first chunk and its end only
                sent = time.perf_counter()
            else:
                held.append(chunk)
                now = time.perf_counter()
                interval = self._interval() if callable(self._interval) else self._interval
                if chunk.finish_reason is None and sent is not None and now - sent < interval:
                    return
                sent = now
                item = merge_chunks(held)
                held.clear()
            mailbox.post(self._arrive, index, item)

        return sink

    def _arrive(self, index: int, item: Any) -> None:
        """On the event loop: a choice's chunk (its held steps merged), result or error."""
        if isinstance(item, StreamChunk):
            self.first_token_at = self.first_token_at or time.perf_counter()
        elif isinstance(item, GenerationResult):
            self._results[index] = item
        elif isinstance(item, BaseException):
            self.cancel()  # the other choices stop at their next step
            self._end(None, item)
        if self._queue is not None:
            self._queue.put_nowait((index, item))
        if len(self._results) == len(self.streams):
            self._end([self._results[i] for i in range(len(self.streams))], None)

    def _end(self, results: list[GenerationResult] | None, error: BaseException | None) -> None:
        assert self._done is not None
        if not self._done.done():
            if error is not None:
                self._done.set_exception(error)
                self._done.exception()  # retrieved: a job nobody awaits logs no warning
            else:
                self._done.set_result(results or [])
        self.finish(results)

    async def chunks(self) -> AsyncGenerator[tuple[int, StreamChunk]]:
        """Yields (choice index, chunk) as the choices deliver them (gathered over the
        interval given to :meth:`deliver`), until every choice ended; raises what failed one.
        Leaving early cancels the job (its rows go at the next step).

        Events that queued up while the consumer was busy go out as one chunk a choice (under
        load every event costs the replica, the proxy and the client). Gathering is decided as
        steps arrive, not on a timer: no wake-ups of the event loop beside the decode thread;
        a gathered step waits at most the interval and one step more."""
        assert self._queue is not None, "deliver(stream=True) first"
        ended = 0
        held: _Event | None = None
        try:
            while ended < len(self.streams):
                index, item = held or await self._queue.get()
                held = None
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, GenerationResult):
                    ended += 1
                    continue
                steps = [item]
                while held is None and not self._queue.empty():
                    following = self._queue.get_nowait()
                    if following[0] == index and isinstance(following[1], StreamChunk):
                        steps.append(following[1])
                    else:
                        held = following
                yield index, merge_chunks(steps)
        finally:
            self.cancel()  # frees its rows at the next step (a no-op once they ended)


class _Mailbox:
    """What the decoding thread hands one event loop, delivered in order by one callback per
    batch: a step's chunks for many streams wake the loop once, not once a row (each wake-up
    is a write to the loop's socket and a turn of the GIL between the decoding thread and
    the loop's)."""

    _of: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weak: the registry's value must not keep its key (the loop) alive.
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[..., None], tuple[Any, ...]]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        """The loop's mailbox (made on its first use, on the loop's thread)."""
        mailbox = cls._of.get(loop)
        if mailbox is None:
            mailbox = cls._of[loop] = cls(loop)
        return mailbox

    def post(self, callback: Callable[..., None], *args: Any) -> None:
        """From any thread: ``callback(*args)`` on the loop, after what was posted before."""
        with self._lock:
            self._items.append((callback, args))
            wake = len(self._items) == 1  # else a delivery is already on its way
        if wake:
            try:
                self._running_loop().call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed or gone: so is the replica
                with self._lock:
                    self._items.clear()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("the event loop is gone")
        return loop

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for callback, args in items:
            try:
                callback(*args)
            except Exception as exc:  # noqa: BLE001 - one callback's fault spares the rest
                self._running_loop().call_exception_handler(
                    {"message": "a delivery to the event loop failed", "exception": exc}
                )
