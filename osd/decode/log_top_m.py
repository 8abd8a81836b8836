"""The target's top-m that a step hands the log, computed beside the decoding thread on a CPU.

A logged request keeps the target's m most likely tokens and their probabilities at every
position it emitted (the trainer distils from them). On an accelerator the top-m is a kernel
queued on the device and read after the step's one host sync (:func:`osd.devices.on_host`).
On a CPU it ran in the decoding thread: a ``topk`` over the vocabulary at every position a step
verified, 0.8 ms of a 16-row step of four positions a row (the demo target's step: 6-12 ms),
and a logged speculative step took 5-8 % longer than an unlogged one (``docs/benchmarks.md``).

So on a CPU one worker thread computes it while the decoding thread goes on with the next
step: torch's kernels let the GIL go, so the worker runs on a core the decoding thread is not
using. It is handed the step after its host sync, with how many positions each row kept, and
computes those alone (a row verifies k + 1 positions and keeps the accepted ones and the next:
with a draft the target rejects, one of five). A pair keeps at most one step's top-m in flight
(it waits for the last one before it hands over the next), so what waits is one step's logits,
never a backlog. A row keeps its share of each step (:class:`LoggedPositions`) and reads it
when its log is built, after it finished. A request handle whose row ended while its last
step's top-m was still on its way hands the end to its sink from the worker's thread, once it
landed (:meth:`osd.decode.loop.RequestHandle.deliver_to`): building the log never waits in the
decoding thread. The worker is one thread for the process, shared by its pairs.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from osd.devices import on_host
from osd.threads import single_threaded_torch

__all__ = ["LogTopM", "LoggedPositions", "StepTopM", "top_m_distribution"]


def top_m_distribution(logits: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target's top-m at temperature 1: (..., V) logits -> (..., m) ids and probs."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, m, dim=-1)
    return top.indices, top.values


@torch.inference_mode()
def _on_host_top_m(
    logits: torch.Tensor, m: int, kept: list[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The top-m of (R, T, V) ``logits`` as host arrays: (R, T, m), or with ``kept`` (each
    row's first positions) (sum(kept), m), the rows' positions one after another."""
    if kept is not None:
        counts = torch.tensor(kept, dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(len(kept)), counts)
        starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        logits = logits[rows, torch.arange(len(rows)) - starts]
    ids, probs = on_host(*top_m_distribution(logits, m))
    return ids, probs


class StepTopM:
    """One step's top-m, landed or on its way: (R, T, m) ids and probabilities, or each row's
    kept positions one after another (``kept``)."""

    def __init__(
        self,
        result: tuple[np.ndarray, np.ndarray] | Future,
        kept: list[int] | None = None,
    ) -> None:
        self._result = result
        self._offsets = None if kept is None else np.cumsum([0, *kept[:-1]]).tolist()

    def pending(self) -> Future | None:
        """The worker's future while it has not landed; None once it has (or where there is
        none)."""
        result = self._result
        return result if isinstance(result, Future) and not result.done() else None

    def arrays(self, row: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``row``'s first ``count`` positions, (count, m) ids and probabilities (waits
        for the worker where they are on their way; on an accelerator, valid once the step's
        host sync has passed)."""
        result = self._result
        if isinstance(result, Future):
            result = self._result = result.result()
        ids, probs = result
        if self._offsets is None:
            return ids[row, :count], probs[row, :count]
        first = self._offsets[row]
        return ids[first : first + count], probs[first : first + count]


@dataclass(frozen=True)
class LoggedPositions:
    """A row's share of one step's top-m: row ``row`` of ``step``, its first ``count``
    positions (those the step emitted)."""

    step: StepTopM
    row: int
    count: int

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(count, m) ids and probabilities."""
        return self.step.arrays(self.row, self.count)


_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def _forget_worker() -> None:
    """In a forked child: the parent's worker thread is not there, so a new one is made."""
    global _worker, _worker_lock
    _worker, _worker_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_worker)


def _shared_worker() -> ThreadPoolExecutor:
    """The process's one top-m thread (single-threaded torch: a thread that runs torch in
    parallel keeps an OpenMP team beside the decoding thread's; see :mod:`osd.threads`)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="osd-log-top-m", initializer=single_threaded_torch
            )
        return _worker


class LogTopM:
    """Starts a pair's steps' top-m: queued on the device before the step's host sync on an
    accelerator (:meth:`before_sync`), by the worker after it on a CPU (``beside``,
    :meth:`after_sync`). Called from the pair's decoding thread only."""

    def __init__(self, m: int, device: torch.device, beside: bool | None = None) -> None:
        self.m = m
        self.beside = device.type == "cpu" if beside is None else beside
        self._last: Future | None = None

    def before_sync(self, logits: torch.Tensor) -> StepTopM | None:
        """The top-m of every position of (R, T, V) ``logits``, queued now; None where the
        worker computes it after the sync instead."""
        return None if self.beside else self.now(logits)

    def after_sync(self, logits: torch.Tensor, kept: list[int]) -> StepTopM:
        """The top-m of each row's first ``kept[row]`` positions of (R, T, V) ``logits``, a
        tensor of the step's own that nothing writes afterwards (the worker reads it while
        the decoding thread goes on)."""
        if self._last is not None:
            wait([self._last])  # at most one step's logits waiting
        try:
            self._last = _shared_worker().submit(_on_host_top_m, logits, self.m, kept)
        except RuntimeError:  # the interpreter is shutting down: no new threads' work
            return StepTopM(_on_host_top_m(logits, self.m, kept), kept)
        return StepTopM(self._last, kept)

    def now(self, logits: torch.Tensor) -> StepTopM:
        """The top-m of every position, computed in the calling thread (a prefill's first
        tokens: one position a row), or queued on the device."""
        return StepTopM(_on_host_top_m(logits, self.m))
