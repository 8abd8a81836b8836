"""CUDA graphs of the lean forward's decoder layers (``model.cuda_graphs``, on CUDA only; off
by default: a capture while another thread of the process copies between host and GPU makes
torch refuse that copy, seen on an H200. A capture that fails here runs its forward, and its
bucket from then on, ungraphed. ``docs/batched_engine.md``, "CUDA graphs").

At serving sizes a decode step on a GPU is launch-bound: a forward is hundreds of small
kernels, each launched from Python (on the H200 the eager forward of a 1B-shaped model ran
at 30-58 tokens/s at batch 1). A CUDA graph records those launches once and replays them as
one. What is
recorded is the layers function of :mod:`osd.decode.lean_forward` (compiled or not) over the
rows' slot cache, for the forwards whose rows read their keys in place (consecutive slots,
every column computed: every decode step of rows in step, the target alone's and most verify
steps); embedding, rotary tables and the head run before and after it as they do eagerly.

A graph replays fixed shapes at fixed addresses, so each call's inputs are copied into static
buffers of a *bucket*: the batch rounded up to a power of two (the extra rows read the trash
slot and write their keys there; their outputs are dropped), the tokens a row as they are, and
the keys read rounded up to a power of two of at least 32 (never past the cache's capacity),
the extra columns masked. Rows read their slots through an index (``index_select``) rather than
as a view of the storage, since a view's address would depend on the first row's slot: a copy
of the rows' keys up to the bucket's length, each layer, which a paged-attention kernel would
avoid. One graph is captured per bucket on its first use (the replica's warm-up runs every
batch size before it reports ready), into one memory pool per model (a new one once all its
graphs are gone), at most ``max_graphs`` of them (least recently used dropped first); all are
dropped when the cache reallocates its storage (it grew), since their addresses are then
stale. Batches past the largest bucket run the layers function directly.

Exactness: a graph replays the same kernels on the same values; the masked extra columns add
exact zeros to the softmax's sums, which may change their order and so the last bits, as
compilation does. Every token still comes from this one forward, so verification stays exact.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from osd.decode.compiled_forward import compile_stats

__all__ = ["GraphedLayers", "Replay", "cuda_graph_replay"]

log = logging.getLogger(__name__)

_MIN_KEYS = 32
_MAX_BATCH = 512  # larger batches run ungraphed (each graph's buffers grow with its batch)

# A captured layers call: replays it on its static inputs (their values as they are now).
Replay = Callable[[], None]
# Captures ``run`` (a call of the layers function on the static inputs, returning its output)
# and returns the output tensor and its replay; ``pool`` is the model's memory pool.
Recorder = Callable[[Callable[[], torch.Tensor], Any], tuple[torch.Tensor, Replay]]


def cuda_graph_replay(run: Callable[[], torch.Tensor], pool: Any) -> tuple[torch.Tensor, Replay]:
    """Captures ``run`` into a CUDA graph: one warm-up call on a side stream first (it
    allocates cuBLAS workspaces and, compiled, compiles; its writes are the real keys of this
    call's rows), then the capture, whose replay is returned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the capture does not forbid other threads' CUDA calls (torch may still
    # refuse their host copies meanwhile: why model.cuda_graphs is off by default)
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return out, graph.replay


@dataclass
class _Entry:
    """One bucket's graph: its static inputs, its output and its replay."""

    hidden: torch.Tensor  # (B, T, hidden)
    cos: torch.Tensor  # (B, T, 1, D)
    sin: torch.Tensor
    mask: torch.Tensor  # (B, 1, T, S)
    write_index: torch.Tensor  # (B * T,) flat positions in the storage
    slots: torch.Tensor  # (B,)
    out: torch.Tensor  # (B, T, hidden)
    replay: Replay


def bucket_of(size: int, floor: int = 1) -> int:
    """The power of two at least ``size`` and ``floor``."""
    return max(floor, 1 << max(0, size - 1).bit_length())


class GraphedLayers:
    """``layers`` (called as ``layers(hidden, cos, sin, mask, keys, values, write_index,
    slots)``, :func:`osd.decode.lean_forward._in_place_layers`) replayed from CUDA graphs, one
    per bucket (module docstring)."""

    def __init__(
        self,
        layers: Callable[..., torch.Tensor],
        *,
        max_graphs: int = 64,
        recorder: Recorder = cuda_graph_replay,
        new_pool: Callable[[], Any] = torch.cuda.graph_pool_handle,
    ) -> None:
        """``recorder`` captures a call (:func:`cuda_graph_replay`; tests stand in for it on the
        CPU); ``new_pool`` makes the memory pool the graphs share."""
        self._layers = layers
        self._max_graphs = max_graphs
        self._record = recorder
        self._new_pool = new_pool
        self._pool: Any = None
        self._graphs: collections.OrderedDict[tuple[int, int, int], _Entry] = (
            collections.OrderedDict()
        )
        self._storage: tuple[int, ...] = ()  # the data pointers the graphs were captured over
        self._failed: set[tuple[int, int, int]] = set()  # buckets whose capture failed
        self.captures = 0
        self.capture_failures = 0

    @property
    def graphs(self) -> int:
        """Graphs held now."""
        return len(self._graphs)

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        write_index: torch.Tensor,
        first_slot: int,
    ) -> torch.Tensor:
        """The layers over (B, T, hidden) rows in slots ``first_slot ..``; ``keys``/``values``:
        every layer's whole (slots + 1, capacity, H_kv, D) storage (the last slot the trash);
        ``write_index``: (B * T,) flat positions in it."""
        batch, width = hidden.shape[:2]
        capacity = keys[0].shape[1]
        kv_len = mask.shape[-1]
        storage = tuple(t.data_ptr() for t in (*keys, *values))
        if storage != self._storage:  # the cache grew: every graph points at freed memory
            self._graphs.clear()
            self._failed.clear()
            self._storage = storage
        key = (bucket_of(batch), width, min(capacity, bucket_of(kv_len, _MIN_KEYS)))
        if key[0] > _MAX_BATCH or self._max_graphs <= 0 or key in self._failed:
            slots = torch.arange(first_slot, first_slot + batch, device=hidden.device)
            return self._layers(hidden, cos, sin, mask, keys, values, write_index, slots)
        entry = self._graphs.get(key)
        fresh = entry is None
        if entry is None:
            entry = self._buffers(key, hidden, cos, sin, mask)
        else:
            self._graphs.move_to_end(key)
        self._fill(entry, hidden, cos, sin, mask, write_index, first_slot, keys[0])
        if fresh:  # filled first: the capture's warm-up call runs on this call's inputs
            try:
                self._capture(key, entry, keys, values)
            except RuntimeError:  # the forward still runs, ungraphed, and so does the bucket
                log.warning(
                    "CUDA graph capture failed; bucket %s runs ungraphed", key, exc_info=True
                )
                self._failed.add(key)
                self.capture_failures += 1
                return self._layers(*self._inputs(entry, keys, values))[:batch]
        entry.replay()
        return entry.out[:batch]

    @staticmethod
    def _inputs(entry: _Entry, keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple:
        """The layers function's arguments over ``entry``'s buffers."""
        return (
            entry.hidden,
            entry.cos,
            entry.sin,
            entry.mask,
            keys,
            values,
            entry.write_index,
            entry.slots,
        )

    def _fill(
        self,
        entry: _Entry,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        write_index: torch.Tensor,
        first_slot: int,
        store: torch.Tensor,
    ) -> None:
        """This call's inputs into the bucket's buffers; the extra rows read and write the trash
        slot, and the extra key columns are masked."""
        batch, width = hidden.shape[:2]
        kv_len = mask.shape[-1]
        trash = store.shape[0] - 1
        entry.hidden[:batch].copy_(hidden)
        entry.cos[:batch].copy_(cos)
        entry.sin[:batch].copy_(sin)
        entry.mask[:batch, ..., :kv_len].copy_(mask)
        entry.mask[:batch, ..., kv_len:].fill_(torch.finfo(mask.dtype).min)
        entry.write_index[: batch * width].copy_(write_index)
        entry.write_index[batch * width :].fill_(trash * store.shape[1])
        torch.arange(first_slot, first_slot + batch, out=entry.slots[:batch])
        entry.slots[batch:].fill_(trash)

    def _buffers(
        self,
        key: tuple[int, int, int],
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> _Entry:
        """A bucket's static inputs (the extra rows see one key each: a finite softmax)."""
        padded, width, num_keys = key
        device = hidden.device
        entry = _Entry(
            hidden=hidden.new_zeros(padded, width, hidden.shape[-1]),
            cos=cos.new_zeros(padded, *cos.shape[1:]),
            sin=sin.new_zeros(padded, *sin.shape[1:]),
            mask=mask.new_full((padded, 1, width, num_keys), torch.finfo(mask.dtype).min),
            write_index=torch.zeros(padded * width, dtype=torch.int64, device=device),
            slots=torch.zeros(padded, dtype=torch.int64, device=device),
            out=hidden,  # the graph's own, once captured
            replay=_not_captured,
        )
        entry.mask[..., 0] = 0
        return entry

    def _capture(
        self,
        key: tuple[int, int, int],
        entry: _Entry,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> None:
        """Captures the layers over ``entry``'s buffers (filled) and keeps the graph, the least
        recently used one dropped first when ``max_graphs`` are held."""
        if len(self._graphs) >= self._max_graphs:
            self._graphs.popitem(last=False)
        if not self._graphs:
            # A pool whose graphs are all gone cannot take another capture while blocks of
            # theirs are still allocated (torch asserts): the next graphs get a pool of their own.
            self._pool = self._new_pool()

        def run() -> torch.Tensor:
            return self._layers(*self._inputs(entry, keys, values))

        started = time.perf_counter()
        entry.out, entry.replay = self._record(run, self._pool)
        compile_stats().add_capture(time.perf_counter() - started)
        self._graphs[key] = entry
        self.captures += 1


def _not_captured() -> None:
    raise RuntimeError("replay of a CUDA graph not captured yet")
