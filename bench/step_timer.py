"""Times :func:`osd.decode.step.run_step` alone while a batched engine decodes a batch (the step
benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

import osd.decode.loop
from osd import SpeculativeDecoder
from osd.decode.loop import BatchedEngine
from osd.decode.request import DecodeRequest
from osd.decode.scheduler import BatchLimits

__all__ = ["step_times"]


def step_times(decoder: SpeculativeDecoder, requests: Sequence[DecodeRequest]) -> list[float]:
    """Decodes ``requests`` as one batch in a fresh engine; the seconds of each of its steps
    (CUDA synchronised after each step, so a step's time is its own)."""
    times: list[float] = []
    real = osd.decode.loop.run_step

    def timed(*args: Any) -> Any:
        started = time.perf_counter()
        out = real(*args)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        return out

    osd.decode.loop.run_step = timed  # type: ignore[assignment]
    size = len(requests)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=size, kv_slots=size))
    try:
        for handle in [engine.submit(request) for request in requests]:
            handle.result()
    finally:
        engine.close()
        osd.decode.loop.run_step = real  # type: ignore[assignment]
    return times
