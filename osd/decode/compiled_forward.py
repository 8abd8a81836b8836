"""``model.compile``: the lean forward's decoder layers through ``torch.compile``.

What is compiled is :func:`osd.decode.lean_forward._in_place_layers`: the layers of a forward
whose rows read their keys in place (consecutive slots, full-length storage, every column
computed), which is every decode step of rows in step, the target alone's and most verify
steps. It takes plain tensors, so its graph depends on no host state of the engine. The batch,
the tokens per row, the context and the cache's slots and capacity are dynamic from the first
compilation, so a changing batch mix does not recompile: there is one graph for each of one
row or several, times one token a row, a few (up to 16: decode and verify steps attend by
products and sums on the CPU, ``lean_forward._attend_by_products``) or more (prefills: SDPA),
six in all (torch specializes sizes of 1). Other forwards (packed, gathered, rings, LoRA
layers, and the first forward of a one-token prompt, whose context of 1 would be a graph of
its own, and a step whose longest row fills the cache's storage exactly) run the same Python
eagerly.

Inductor fuses the elementwise work between the matmuls (norms, rotary, SiLU gate,
residuals) and the KV writes; outputs differ from the eager ones in the last bits (sums in
another order). Every token still comes from this one forward, so verification stays exact.
Compiling costs seconds to tens of seconds a graph on a small CPU, the first time; inductor
keeps what it compiled in its on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, by default here
under osd's cache directory rather than torch's ``/tmp``), so a restart takes seconds. The
replica's warm-up (:mod:`osd.decode.warmup`) runs every batch size before the replica
reports ready, so no request pays for a compilation, and :func:`compile_stats` counts every
one (``osd_engine_compilations_total``: it should not move once a replica serves). On by
default (``model.compile``); a compilation that fails (no C++ compiler, a backend that cannot
build the graph) fails before its graph runs, and that model's layers then run eagerly, with
one warning. Measured in ``docs/batched_engine.md``.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from osd.cache_dir import osd_cache_dir

log = logging.getLogger(__name__)

__all__ = ["CompileStats", "compile_stats", "compiled_layers", "persistent_inductor_cache"]

# Graphs one model's compiled layers may hold before torch runs them eagerly: the six shapes
# above, with room to spare. Each model counts alone (``isolate_recompiles``): by default every
# compiled call of one function shares the limit (the target's and a plain draft's, or every
# engine a process builds).
_RECOMPILE_LIMIT = 8
# Where torch cannot count each model alone: the limit all models' compiled layers share.
_SHARED_RECOMPILE_LIMIT = 64


@dataclass
class CompileStats:
    """Compilations in this process: graphs compiled, and the seconds inductor took; CUDA
    graphs captured, and the seconds their captures took."""

    compilations: int = 0
    seconds: float = 0.0
    captures: int = 0  # CUDA graphs captured (osd.decode.cuda_graphs)
    capture_seconds: float = 0.0
    failures: int = 0  # models whose compilation failed: they run eagerly
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_failure(self) -> None:
        with self._lock:
            self.failures += 1

    def add(self, seconds: float) -> None:
        with self._lock:
            self.compilations += 1
            self.seconds += seconds

    def add_capture(self, seconds: float) -> None:
        with self._lock:
            self.captures += 1
            self.capture_seconds += seconds


_STATS = CompileStats()


def compile_stats() -> CompileStats:
    """This process's compilations (every compiled forward counts here)."""
    return _STATS


# Inductor's code checks every input's sizes and strides on every call (``size_asserts``):
# about 150 checks a step on the demo target, one per weight and store, which dynamo's guards
# already check for the inputs that vary (the weights never do).
_INDUCTOR_PATCHES = {"size_asserts": False}


def _counting_inductor(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Inductor, counted: dynamo calls its backend once for each graph it compiles."""
    from torch._inductor.compile_fx import compile_fx

    started = time.perf_counter()
    compiled_graph = compile_fx(graph, example_inputs, config_patches=_INDUCTOR_PATCHES)
    _STATS.add(time.perf_counter() - started)
    return compiled_graph


LayersFunction = Callable[..., torch.Tensor]


def _inputs_guards(entries: list[Any]) -> list[bool]:
    """Dynamo's guards to keep: all but those on the model's own layers (their weights,
    callables and sizes: ``fn``, the partial's bound first argument of
    ``_in_place_layers``). Each model's graphs are its own (``isolate_recompiles``) and its
    layers never change, so those guards can only pass; with them dynamo's cache lookup took
    0.36 ms a step on the demo target at batch 16, 0.11 ms without (in the profiler). The
    inputs' guards, which choose among a model's graphs, all stay."""
    return [not (entry.name == "fn" or entry.name.startswith("fn.")) for entry in entries]


def _compile(layers: LayersFunction) -> Any:
    """``torch.compile`` of ``layers`` through the counting inductor, each model's recompiles
    counted alone where this torch takes that (2.13 does, 2.11 does not); elsewhere dynamo's
    one limit per function is raised to cover every model a process compiles."""
    import torch._dynamo as dynamo

    options: dict[str, Any] = {"backend": _counting_inductor, "dynamic": None}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        options |= {
            "recompile_limit": _RECOMPILE_LIMIT,
            "isolate_recompiles": True,
            "options": {"guard_filter_fn": _inputs_guards},
        }
    else:
        config: Any = dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), _SHARED_RECOMPILE_LIMIT))
    return torch.compile(layers, **options)  # type: ignore[call-overload]  # (stubs lag)


def persistent_inductor_cache() -> Path:
    """Inductor's on-disk cache: ``TORCHINDUCTOR_CACHE_DIR`` where set, else set to
    ``$OSD_CACHE_DIR/inductor`` (``~/.cache/osd/inductor`` without it). torch's own default is
    under ``/tmp``, which a reboot empties: a replica restarted after one compiled everything
    again (148 s of inductor on a 2-core machine for the demo pair, 41 s from the cache).
    torch writes its default into the variable itself the first time it looks (importing osd
    does, through transformers), so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(osd_cache_dir() / "inductor")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def compiled_layers(layers: LayersFunction) -> LayersFunction:
    """``layers`` (called as ``_in_place_layers`` without its first argument) compiled, with
    the sizes that change from step to step dynamic and the model's own sizes (hidden, heads,
    head dimension) static, so the kernels are specialized to them; compiled into
    :func:`persistent_inductor_cache`."""
    import torch._dynamo as dynamo
    import torch._dynamo.exc as dynamo_exc

    persistent_inductor_cache()
    function = _compile(layers)
    marked: list[weakref.ref[torch.Tensor]] = []  # the stores last marked dynamic
    failed: list[str] = []  # why compiling failed: from then on this model runs eagerly

    def run(*inputs: Any) -> torch.Tensor:
        """``_in_place_layers``' inputs: hidden, cos, sin, mask, keys, values, write index,
        slots (None: the rows' slots are consecutive) and the first slot as a size."""
        hidden, cos, sin, mask, keys, values, write_index, slots, *rest = inputs
        first = rest[0] if rest else None
        if failed or mask.shape[-1] < 2 or mask.shape[-1] == keys[0].shape[1]:
            # A one-token prompt's forward, and a step whose longest row fills the storage
            # (keys read as the whole storage, a contiguous view: torch guards on it): eager,
            # not graphs of their own.
            return layers(*inputs)
        stores = (*keys, *values)
        # A mark stays with its tensor, and the stores live as long as the cache's storage:
        # marked again when the cache grew, not at every step (48 calls on the demo target).
        fresh = len(stores) != len(marked) or any(
            ref() is not store for ref, store in zip(marked, stores, strict=True)
        )
        for tensor, dims in (
            (hidden, (0, 1)),  # rows, tokens a row
            (cos, (0, 1)),
            (sin, (0, 1)),
            (mask, (0, 2, 3)),  # rows, tokens a row, keys
            (write_index, (0,)),
            *(() if slots is None else ((slots, (0,)),)),
            *(() if first is None else ((first, (0,)),)),
            *((store, (0, 1)) for store in stores if fresh),  # slots, capacity
        ):
            for dim in dims:
                dynamo.maybe_mark_dynamic(tensor, dim)
        if fresh:
            marked[:] = [weakref.ref(store) for store in stores]
        try:
            out: torch.Tensor = function(*inputs)
        except dynamo_exc.TorchDynamoException as e:
            # Raised while tracing or compiling, before the graph ran (nothing was written):
            # a missing C++ compiler, a backend that cannot build the graph. Serving goes on
            # eagerly, with the same outputs as model.compile off.
            failed.append(" ".join(str(e).split())[:300])
            _STATS.add_failure()
            log.warning(
                "torch.compile failed (%s: %s); this model's layers run eagerly from now on "
                "(model.compile=false does so from the start)",
                type(e).__name__,
                failed[0],
            )
            return layers(*inputs)
        return out

    return run
