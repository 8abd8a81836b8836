"""An admitted request (:class:`Job`) and the streaming of its choices to the event loop.

A job holds one :class:`osd.decode.loop.RequestHandle` per choice (OpenAI's ``n``,
:mod:`osd.decode.choices`). Handles block, so a thread of the replica's pool waits on each
choice's; what they bring goes to the event loop through one queue, tagged with the choice's
index, and steps of one choice that queued up while the consumer was busy go out as one chunk.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from osd.decode.generation import GenerationResult, StreamChunk, merge_chunks
from osd.decode.loop import RequestHandle
from serving.adapter_slots import AdapterLease
from serving.protocol import ChatRequest, CompletionRequest, new_id
from serving.router import RouteDecision
from serving.tools import ToolPlan

__all__ = ["Job", "stream_choices"]

Finish = Callable[["Job", "list[GenerationResult] | None"], None]


@dataclass
class Job:
    """One admitted request: its choices' streams, route and adapter lease."""

    request: CompletionRequest | ChatRequest
    streams: list[RequestHandle]  # one per choice (OpenAI's n), in order
    route: RouteDecision
    lease: AdapterLease
    request_id: str = field(default_factory=lambda: new_id("req"))
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    decoding: bool = False  # a streamed job's thread was started (it then finishes the job)
    finished: bool = False  # lease and admission slot given back (exactly once)
    tools: ToolPlan | None = None  # its replies are read for tool calls

    @property
    def stream(self) -> RequestHandle:
        """The first choice's stream (its request has the settings all choices share)."""
        return self.streams[0]

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()

    def results(self) -> list[GenerationResult]:
        """Waits for every choice's end (in a worker thread)."""
        return [stream.result() for stream in self.streams]


async def stream_choices(
    job: Job,
    executor: Executor,
    finish: Finish,
    finish_when_done: Callable[[Job, asyncio.Future[Any]], None],
) -> AsyncGenerator[tuple[int, StreamChunk]]:
    """Yields (choice index, chunk) as the pool's threads bring them; cancels if the consumer
    stops.

    The clean-up never awaits: a consumer that is cancelled (the client disconnected) may
    not wait for anything, so the threads that decode account for the request when they
    stop, after their current step.

    Args:
        job: the admitted request.
        executor: the threads that wait on the choices' handles.
        finish: accounts for the job once (its results, or None when it failed).
        finish_when_done: calls ``finish`` when the threads' future ends.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()
    stop = threading.Event()

    def pump(index: int, stream: RequestHandle) -> GenerationResult | None:
        try:
            if stop.is_set():  # gone while this waited for a thread
                stream.cancel()
            for chunk in stream:
                loop.call_soon_threadsafe(queue.put_nowait, ("chunk", index, chunk))
                if stop.is_set():
                    stream.cancel()
                    break
            result = stream.result()
            loop.call_soon_threadsafe(queue.put_nowait, ("done", index, result))
            return result
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop
            loop.call_soon_threadsafe(queue.put_nowait, ("error", index, exc))
            return None

    pumps = [
        loop.run_in_executor(executor, pump, i, stream) for i, stream in enumerate(job.streams)
    ]
    finish_when_done(job, asyncio.gather(*pumps))
    job.decoding = True  # (if the pool is shut down, the raise above leaves it to abandon)
    results: dict[int, GenerationResult] = {}
    held: tuple[str, int, Any] | None = None
    try:
        while True:
            kind, index, item = held or await queue.get()
            held = None
            if kind == "chunk":
                # Steps that queued up while the consumer was busy go out as one chunk:
                # under load every event costs the proxy, the replica and the client.
                steps = [item]
                while held is None and not queue.empty():
                    following = queue.get_nowait()
                    if following[:2] == ("chunk", index):
                        steps.append(following[2])
                    else:
                        held = following
                job.first_token_at = job.first_token_at or time.perf_counter()
                yield index, merge_chunks(steps)
                continue
            if kind == "error":
                finish(job, None)
                raise item
            results[index] = item
            if len(results) == len(job.streams):  # every pump is done
                finish(job, [results[i] for i in range(len(results))])
                return
    finally:
        stop.set()  # the consumer went away (or the stream ended): the pumps stop
        job.cancel()  # frees its rows at the next step, even before a chunk came
