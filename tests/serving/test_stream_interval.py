"""``serve.stream_interval_ms``: a streamed request's steps gathered into fewer events.

The job's delivery is driven here by a stand-in for the decode thread's handle (a thread that
calls the job's sink, as the engine's loop does), so the timing is the event loop's own."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from osd.decode.generation import GenerationResult, GenerationStats, StreamChunk
from serving.jobs import Job


class _Handle:
    """A choice's handle as the job sees it: deliveries come from another thread."""

    def __init__(self) -> None:
        self.sink: Callable[[StreamChunk | None], None] | None = None
        self.tokens: list[int] = []
        self.cancelled = False

    def deliver_to(self, sink: Callable[[StreamChunk | None], None]) -> None:
        self.sink = sink

    def step(self, token: int, finish: Any = None) -> None:
        assert self.sink is not None
        self.tokens.append(token)
        self.sink(StreamChunk([token], f"t{token} ", finish))

    def end(self) -> None:
        assert self.sink is not None
        self.sink(None)

    def result(self) -> GenerationResult:
        text = "".join(f"t{t} " for t in self.tokens)
        return GenerationResult(self.tokens, text, "length", GenerationStats())

    def cancel(self) -> None:
        self.cancelled = True


def _job(handle: _Handle) -> Job:
    return Job(request=None, streams=[handle], route=None, lease=None)  # type: ignore[arg-type]


async def _read(job: Job, interval: float) -> list[tuple[float, list[int], str | None]]:
    """Every event: (seconds since the first, its tokens, its finish reason)."""
    job.deliver(stream=True)
    events: list[tuple[float, list[int], str | None]] = []
    started: float | None = None
    async for _, chunk in job.chunks(interval):
        now = time.perf_counter()
        started = now if started is None else started
        events.append((now - started, chunk.token_ids, chunk.finish_reason))
    return events


def _decode(handle: _Handle, steps: int, step_s: float, last_after_s: float = 0.0) -> None:
    """The decode thread: ``steps`` tokens ``step_s`` apart, the last one (which ends the
    request) ``last_after_s`` after the one before it, then the end."""
    for token in range(steps):
        time.sleep(last_after_s if token == steps - 1 and last_after_s else step_s)
        handle.step(token, "length" if token == steps - 1 else None)
    handle.end()


def _run(interval: float, steps: int, step_s: float, last_after_s: float = 0.0) -> Any:
    handle = _Handle()
    job = _job(handle)

    async def main() -> list[tuple[float, list[int], str | None]]:
        reading = asyncio.ensure_future(_read(job, interval))
        await asyncio.sleep(0)  # delivery starts before the decode thread does
        thread = threading.Thread(target=_decode, args=(handle, steps, step_s, last_after_s))
        thread.start()
        try:
            return await reading
        finally:
            thread.join()

    return asyncio.run(main())


def test_steps_within_an_interval_go_out_as_one_event() -> None:
    events = _run(interval=0.1, steps=20, step_s=0.01)
    tokens = [t for _, ids, _ in events for t in ids]
    assert tokens == list(range(20))  # nothing lost, in order
    assert events[0][1] == [0]  # the first token at once
    assert 2 <= len(events) <= 6  # 20 steps of 10 ms in 100 ms events (timing slack)
    assert events[-1][2] == "length"
    times = [at for at, _, _ in events]
    # Events after the first are at least an interval apart, but for the ending.
    assert all(b - a >= 0.09 for a, b in zip(times[:-2], times[1:-1], strict=True))


def test_without_an_interval_every_step_is_an_event_when_the_reader_keeps_up() -> None:
    events = _run(interval=0.0, steps=10, step_s=0.01)
    assert [ids for _, ids, _ in events] == [[t] for t in range(10)]


def test_the_ending_goes_out_at_once() -> None:
    # The last token comes 20 ms after the one before it, well within the 1 s interval: it
    # must not wait for the interval to pass.
    started = time.perf_counter()
    events = _run(interval=1.0, steps=3, step_s=0.01, last_after_s=0.02)
    assert time.perf_counter() - started < 0.6
    assert [t for _, ids, _ in events for t in ids] == [0, 1, 2]
    assert events[-1][2] == "length"


def test_a_slow_decoder_is_not_held_back() -> None:
    # Steps slower than the interval: each goes out as it comes.
    events = _run(interval=0.01, steps=4, step_s=0.05)
    assert [ids for _, ids, _ in events] == [[0], [1], [2], [3]]


def test_several_choices_lose_nothing_and_keep_their_order() -> None:
    handles = [_Handle(), _Handle()]
    job = Job(request=None, streams=handles, route=None, lease=None)  # type: ignore[arg-type]

    def decode() -> None:
        for token in range(12):
            time.sleep(0.005)
            for handle in handles:
                handle.step(token, "length" if token == 11 else None)
        for handle in handles:
            handle.end()

    async def main() -> list[tuple[int, list[int]]]:
        job.deliver(stream=True)
        thread = threading.Thread(target=decode)
        thread.start()
        try:
            return [(index, chunk.token_ids) async for index, chunk in job.chunks(0.02)]
        finally:
            thread.join()

    events = asyncio.run(main())
    for index in (0, 1):
        assert [t for i, ids in events if i == index for t in ids] == list(range(12))
    # Each choice gathers its own steps: interleaved, they do not flush each other.
    assert len(events) < 2 * 12 // 2
