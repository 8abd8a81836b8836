"""``serve.stream_interval_ms``: a streamed request's steps gathered into fewer events.

The job's delivery is driven on the event loop by a stand-in for the engine's handles (which
call the job's sink, as the decode thread does), against a clock the test sets: which steps
go out together depends on when they come, never on this machine's speed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from osd.decode.generation import GenerationResult, GenerationStats, StreamChunk
from serving import jobs
from serving.jobs import Job

Event = tuple[int, list[int], str | None]  # choice, tokens, finish reason


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(jobs.time, "perf_counter", fake)
    return fake


class _Handle:
    """A choice's handle as the job sees it."""

    def __init__(self) -> None:
        self.sink: Callable[[StreamChunk | None], None] | None = None
        self.tokens: list[int] = []

    def deliver_to(self, sink: Callable[[StreamChunk | None], None]) -> None:
        self.sink = sink

    def step(self, token: int, final: bool = False) -> None:
        assert self.sink is not None
        self.tokens.append(token)
        self.sink(StreamChunk([token], f"t{token} ", "length" if final else None))

    def end(self) -> None:
        assert self.sink is not None
        self.sink(None)

    def result(self) -> GenerationResult:
        text = "".join(f"t{t} " for t in self.tokens)
        return GenerationResult(self.tokens, text, "length", GenerationStats())

    def cancel(self) -> None:
        pass


class _Stream:
    """A job's stream read on the event loop while the test delivers its steps."""

    def __init__(self, handles: list[_Handle], interval: float) -> None:
        self.job = Job(request=None, streams=handles, route=None, lease=None)  # type: ignore[arg-type]
        self.interval = interval
        self.events: list[Event] = []

    async def __aenter__(self) -> _Stream:
        self.job.deliver(stream=True, interval=self.interval)
        self._reading = asyncio.ensure_future(self._read())
        return self

    async def _read(self) -> None:
        async for index, chunk in self.job.chunks():
            self.events.append((index, chunk.token_ids, chunk.finish_reason))

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.wait_for(self._reading, 5)


async def _settle() -> None:
    """Lets the deliveries posted so far reach the reader."""
    for _ in range(10):
        await asyncio.sleep(0)


async def _steps(clock: _Clock, handle: _Handle, times: list[float]) -> None:
    """One token a step at ``times``; the last ends the request."""
    for token, at in enumerate(times):
        clock.now = at
        handle.step(token, final=token == len(times) - 1)
        await _settle()
    handle.end()


def _tokens(events: list[Event], index: int = 0) -> list[list[int]]:
    return [ids for i, ids, _ in events if i == index]


def _one_choice(clock: _Clock, interval: float, times: list[float]) -> list[Event]:
    """The events of one choice streamed with ``interval``, a step at each of ``times``."""

    async def main() -> list[Event]:
        handle = _Handle()
        async with _Stream([handle], interval) as stream:
            await _steps(clock, handle, times)
        return stream.events

    return asyncio.run(main())


def test_steps_within_an_interval_go_out_as_one_event(clock: _Clock) -> None:
    events = _one_choice(clock, 0.095, [0.01 * k for k in range(20)])
    # The first token at once; then the first step 95 ms or more after the last event takes
    # what waited; the ending at once.
    assert _tokens(events) == [[0], list(range(1, 11)), list(range(11, 20))]
    assert events[-1][2] == "length"


def test_without_an_interval_every_step_is_an_event(clock: _Clock) -> None:
    assert _tokens(_one_choice(clock, 0.0, [0.001 * k for k in range(10)])) == [
        [t] for t in range(10)
    ]


def test_the_last_chunk_goes_out_before_its_result(clock: _Clock) -> None:
    async def main() -> tuple[list[Event], list[Event]]:
        handle = _Handle()
        async with _Stream([handle], interval=1.0) as stream:
            for token, at in enumerate([0.0, 0.01, 0.02]):
                clock.now = at
                handle.step(token, final=token == 2)
                await _settle()
            before_end = list(stream.events)  # the result has not come yet
            handle.end()
        return before_end, stream.events

    before_end, events = asyncio.run(main())
    assert _tokens(before_end) == [[0], [1, 2]]
    assert before_end[-1][2] == "length"
    assert events == before_end


def test_steps_slower_than_the_interval_go_as_they_come(clock: _Clock) -> None:
    assert _tokens(_one_choice(clock, 0.01, [0.05 * k for k in range(4)])) == [[0], [1], [2], [3]]


def test_each_choice_gathers_its_own_steps(clock: _Clock) -> None:
    async def main() -> list[Event]:
        handles = [_Handle(), _Handle()]
        async with _Stream(handles, interval=0.019) as stream:
            for token in range(12):  # both choices each step, interleaved
                clock.now = 0.005 * token
                for handle in handles:
                    handle.step(token, final=token == 11)
                await _settle()
            for handle in handles:
                handle.end()
        return stream.events

    events = asyncio.run(main())
    for index in (0, 1):  # nothing lost, in order, and not flushed by the other choice
        assert _tokens(events, index) == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]


def test_an_interval_read_as_steps_arrive_follows_its_changes(clock: _Clock) -> None:
    """The runtime's interval is a callable (its events budget moves with the open streams):
    each step is gathered by the interval read when it arrives."""
    intervals = iter([0.0, 0.0, 0.045, 0.045, 0.045, 0.045, 0.045, 0.0, 0.0, 0.0])

    async def main() -> list[Event]:
        handle = _Handle()
        async with _Stream([handle], interval=lambda: next(intervals)) as stream:  # type: ignore[arg-type]
            await _steps(clock, handle, [0.01 * k for k in range(10)])
        return stream.events

    events = asyncio.run(main())
    # Steps 2-6 gather (45 ms from step 1's event: step 6, 50 ms after it, is the first past it);
    # then each at once.
    assert _tokens(events) == [[0], [1], [2, 3, 4, 5, 6], [7], [8], [9]]


def test_gathered_steps_wake_no_reader(clock: _Clock) -> None:
    """A step held back by the interval is not queued: the stream's reader runs for events
    only."""

    async def main() -> tuple[int, list[Event]]:
        handle = _Handle()
        async with _Stream([handle], interval=1.0) as stream:
            queued = 0
            put = stream.job._queue.put_nowait  # type: ignore[union-attr]

            def counting(item: Any) -> None:
                nonlocal queued
                queued += 1
                put(item)

            stream.job._queue.put_nowait = counting  # type: ignore[union-attr,method-assign]
            await _steps(clock, handle, [0.001 * k for k in range(20)])
        return queued, stream.events

    queued, events = asyncio.run(main())
    assert _tokens(events) == [[0], list(range(1, 20))]
    assert queued == 3  # the first step, the last (with what waited), the result


@pytest.mark.parametrize(
    ("streams", "per_s", "expected"),
    [(1, 400.0, 0.02), (16, 400.0, 0.04), (16, 0.0, 0.02), (500, 400.0, 0.2), (4, 100.0, 0.04)],
)
def test_the_events_budget_lengthens_the_interval_with_the_open_streams(
    streams: int, per_s: float, expected: float
) -> None:
    from types import SimpleNamespace

    from osd.config import ServeConfig
    from serving.runtime import ReplicaRuntime

    serve = ServeConfig(stream_interval_ms=20.0, stream_events_per_s=per_s)
    runtime = SimpleNamespace(config=SimpleNamespace(serve=serve), _streaming=streams)
    assert ReplicaRuntime.stream_interval(runtime) == pytest.approx(expected)  # type: ignore[arg-type]


@pytest.mark.parametrize("per_s", [-1.0, float("nan")])
def test_a_negative_or_unset_events_budget_is_refused(per_s: float) -> None:
    from osd.config import ServeConfig

    with pytest.raises(ValueError, match="serve.stream_events_per_s"):
        ServeConfig(stream_events_per_s=per_s)


def test_a_steps_chunks_for_many_streams_wake_the_event_loop_once(
    clock: _Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decoding thread hands a step's chunks for every stream to the loop's mailbox: one
    callback brings them all, in order; a step held back by the interval posts nothing. (The
    step runs on the loop's thread here, so no delivery can run amid it: in a decoding thread
    one could, whenever the GIL changed hands mid-step.)"""
    wakes: list[int] = []
    deliver = jobs._Mailbox._deliver

    def counted(self: jobs._Mailbox) -> None:
        wakes.append(len(self._items))
        deliver(self)

    monkeypatch.setattr(jobs._Mailbox, "_deliver", counted)

    async def main() -> list[list[Event]]:
        handles = [_Handle() for _ in range(8)]
        streams = [_Stream([handle], interval=0.05) for handle in handles]
        for stream in streams:
            await stream.__aenter__()

        for token, at in enumerate([0.0, 0.01, 0.06]):
            clock.now = at
            for handle in handles:  # a step of the decoding thread
                handle.step(token, final=token == 2)
            await _settle()
        for handle in handles:
            handle.end()
        for stream in streams:
            await stream.__aexit__(None, None, None)
        return [stream.events for stream in streams]

    every = asyncio.run(main())
    # Step 0 goes at once, step 1 is held (posts nothing), step 2 ends: two wake-ups of 8
    # chunks each, then the ends posted from the loop's own thread.
    assert wakes[:2] == [8, 8]
    for events in every:
        assert _tokens(events) == [[0], [1, 2]]


def test_a_closed_event_loop_leaves_no_mailbox_behind(
    clock: _Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry of mailboxes is keyed weakly by loop: a mailbox must not keep its loop
    (and itself) alive once the loop is gone."""
    import gc
    import weakref

    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
    mailbox_of = jobs._Mailbox.of

    def recorded(loop: asyncio.AbstractEventLoop) -> jobs._Mailbox:
        loops.append(weakref.ref(loop))
        return mailbox_of(loop)

    monkeypatch.setattr(jobs._Mailbox, "of", recorded)
    for _ in range(3):
        _one_choice(clock, 0.0, [0.0, 0.01])
    gc.collect()
    assert len(loops) == 3
    assert all(loop() is None for loop in loops)
