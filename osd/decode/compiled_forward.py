"""``model.compile``: the lean forward's decoder layers through ``torch.compile``.

What is compiled is :func:`osd.decode.lean_forward._in_place_layers`: the layers of a forward
whose rows read their keys in place (consecutive slots, full-length storage, every column
computed), which is every decode step of rows in step, the target alone's and most verify
steps. It takes plain tensors, so its graph depends on no host state of the engine. The batch,
the tokens per row, the context and the cache's slots and capacity are dynamic from the first
compilation, so a changing batch mix does not recompile: there is one graph for each of one
row or several, times one token a row, a few (up to 16: decode and verify steps attend by
products and sums on the CPU, ``lean_forward._attend_by_products``) or more (prefills: SDPA),
and three more for rows that compute only their real tokens (packed,
:func:`osd.decode.kv_cache.packing`): several rows of a few tokens (a verify step whose rows
verify different widths), their attention on the whole grid or split with several wide rows
(looked-up drafts beside rows of a token), and a prompt read in a decode step beside them, its
attention on a grid of its own (:func:`osd.decode.kv_cache.attention_split`: one wide row);
nine in all (torch specializes sizes of 1). A LoRA draft's forwards whose rows all run one
adapter (its merged forwards, most draft forwards) run the same graphs with their own
weights (:class:`CompiledModel`): an adapter swapped in compiles nothing. Other forwards
(packed prefills, gathered, rings, rows of mixed adapters, the first forward of a one-token
prompt, whose context of 1 would be a graph of its own, and a step whose longest row fills
the cache's storage exactly) run the same Python eagerly.

On the CPU each shape class (rows up to a power of two, one token a row, a few or many) times
its first calls compiled and eager, alternately, and runs the faster from then on: a tiny
draft's one-row graph loses to its eager layers (the graph's fixed cost per call), its 16-row
one wins (:meth:`_CompiledLayers._trial`); the warm-up is where they settle.

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

import functools
import inspect
import logging
import os
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from osd.cache_dir import osd_cache_dir

log = logging.getLogger(__name__)

__all__ = [
    "FEW_TOKENS",
    "CompileStats",
    "CompiledModel",
    "compile_stats",
    "persistent_inductor_cache",
]

# Graphs one model's compiled layers may hold before torch runs them eagerly: the eight shapes
# above, with room to spare. Each model counts alone (``isolate_recompiles``): by default every
# compiled call of one function shares the limit (the target's and a plain draft's, or every
# engine a process builds).
_RECOMPILE_LIMIT = 10
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
    eager_choices: int = 0  # shape classes whose eager layers beat their graph (trials)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_eager_choice(self) -> None:
        with self._lock:
            self.eager_choices += 1

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
    callables and sizes: ``_in_place_layers``' first argument, ``layers``). Each signature's
    graphs are its own (``isolate_recompiles``) and every forward that calls them has layers
    of that signature (:class:`CompiledModel`), so those guards can only pass; with them
    dynamo's cache lookup took 0.36 ms a step on the demo target at batch 16, 0.11 ms without
    (in the profiler). The inputs' guards, which choose among a model's graphs, all stay."""
    return [not _on_layers(entry.name) for entry in entries]


def _on_layers(source: str) -> bool:
    """Whether a guard's source is the ``layers`` argument or something reached from it."""
    return source == "layers" or source.startswith(("layers[", "layers.", "type(layers["))


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


# Calls of a shape class timed each way (eager, compiled) before it settles on the faster.
_TRIALS = 4
# The most tokens a row of a verify-shaped forward (a verify step's k + 1: 9 at the default
# spec.max_spec_tokens), not a prefill's. The compiled graphs attend by products and sums up to
# this width and by SDPA beyond (lean_forward._products_pay); the trials class shapes by it.
FEW_TOKENS = 16


def _shape_class(mask: torch.Tensor, packed: bool) -> tuple[int, int, bool]:
    """What a forward's speed depends on most: (rows up to a power of two, tokens a row as
    one, a few or many, only the real tokens computed), read off its (B, 1, T, S) mask. The
    graphs are the same for every class of rows; which of compiled and eager is faster is
    not: on the demo draft compiled was 0.82x eager at one row and 1.66x at 16 (one token a
    row, Intel Xeon, one thread)."""
    rows, width = mask.shape[0], mask.shape[2]
    tokens = 1 if width == 1 else 2 if width <= FEW_TOKENS else 3
    return 1 << (rows - 1).bit_length(), tokens, packed


def _describe(shape: tuple[int, int, bool]) -> str:
    rows, tokens, packed = shape
    kind = ("one token", "a few tokens", "many tokens")[tokens - 1]
    return f"up to {rows} row(s), {kind} a row{', packed' if packed else ''}"


class CompiledModel:
    """One model's compiled layers, shared by every lean forward of the model whose layers
    have the same signature (:func:`osd.decode.lean_forward.layers_signature`: the weights'
    sizes, strides, dtypes and devices, and the constants the graph bakes in): the plain
    forward and each LoRA adapter's merged one. Their weights are inputs of the graphs, read
    at every call, and dynamo's guards on them are dropped (:func:`_inputs_guards`), so a
    merged forward made when an adapter is swapped in runs the graphs its model compiled in
    the warm-up, with its own weights, and compiles nothing (a compilation per adapter would
    stall the decode loop for minutes)."""

    def __init__(self) -> None:
        self._by_signature: dict[Hashable, _CompiledLayers] = {}
        self._lock = threading.Lock()

    def layers(self, signature: Hashable, function: LayersFunction, layers: Any) -> LayersFunction:
        """``function`` (``_in_place_layers``) compiled once for ``signature``, bound to
        ``layers``: called with the rest of ``_in_place_layers``' inputs."""
        with self._lock:
            compiled = self._by_signature.get(signature)
            if compiled is None:
                compiled = self._by_signature[signature] = _CompiledLayers(function)
        return functools.partial(compiled, layers)

    @property
    def functions(self) -> int:
        """Compiled functions held: one for each signature seen (one for a model's forwards)."""
        return len(self._by_signature)


class _CompiledLayers:
    """``_in_place_layers`` compiled, with the sizes that change from step to step dynamic and
    the model's own sizes (hidden, heads, head dimension) static, so the kernels are
    specialized to them; compiled into :func:`persistent_inductor_cache`."""

    def __init__(self, function: LayersFunction) -> None:
        persistent_inductor_cache()
        self._eager = function
        self._function = _compile(function)
        self._marked: list[weakref.ref[torch.Tensor]] = []  # the stores last marked dynamic
        self._failed: list[str] = []  # why compiling failed: from then on it runs eagerly
        # Shape class (_shape_class) -> whether the compiled graph beat the eager layers in its
        # trial (absent: not settled yet); on the CPU only, where a call's time is its own.
        self._compiled_pays: dict[tuple[int, int, bool], bool] = {}
        self._times: dict[tuple[int, int, bool], tuple[list[float], list[float]]] = {}

    def __call__(self, layers: Any, *inputs: Any) -> torch.Tensor:
        """``_in_place_layers``' inputs: the layers, hidden, cos, sin, mask, keys, values,
        write index, slots (None: the rows' slots are consecutive), the first slot as a size,
        the packed tokens' index (None: every column computed) and, where a packed forward's
        attention splits in two grids, the tail's columns as a size, the wide rows and the
        tokens' places (:func:`osd.decode.lean_forward._attend_packed`)."""
        import torch._dynamo as dynamo

        hidden, cos, sin, mask, keys, values, write_index, slots, *rest = inputs
        first = rest[0] if rest else None
        packed = rest[1] if len(rest) > 1 else None
        split = [t for t in rest[2:] if t is not None]  # the tail as a size, wide rows, places
        if self._failed or mask.shape[-1] < 2 or mask.shape[-1] == keys[0].shape[1]:
            # A one-token prompt's forward, and a step whose longest row fills the storage
            # (keys read as the whole storage, a contiguous view: torch guards on it): eager,
            # not graphs of their own.
            return self._eager(layers, *inputs)
        stores = (*keys, *values)
        # A mark stays with its tensor, and the stores live as long as the cache's storage:
        # marked again when the cache grew, not at every step (48 calls on the demo target).
        marked = self._marked
        fresh = len(stores) != len(marked) or any(
            ref() is not store for ref, store in zip(marked, stores, strict=True)
        )
        tokens = (0,) if packed is not None else (0, 1)  # (N, ...) or rows, tokens a row
        for tensor, dims in (
            (hidden, tokens),
            (cos, tokens),
            (sin, tokens),
            (mask, (0, 2, 3)),  # rows, tokens a row, keys
            (write_index, (0,)),
            *(() if slots is None else ((slots, (0,)),)),
            *(() if first is None else ((first, (0,)),)),
            *(() if packed is None else ((packed, (0,)),)),
            *((t, (0,)) for t in split),
            *((store, (0, 1)) for store in stores if fresh),  # slots, capacity
        ):
            for dim in dims:
                dynamo.maybe_mark_dynamic(tensor, dim)
        if fresh:
            marked[:] = [weakref.ref(store) for store in stores]
        shape = _shape_class(mask, packed is not None)
        compiled = self._compiled_pays.get(shape)
        if compiled is False:
            return self._eager(layers, *inputs)
        if compiled is None and hidden.device.type == "cpu":
            return self._trial(shape, layers, inputs)
        return self._compiled(layers, inputs)

    def _trial(self, shape: tuple[int, int, bool], layers: Any, inputs: tuple[Any, ...]) -> Any:
        """One call of a shape class not settled yet, eager or compiled (alternately), timed;
        after ``_TRIALS`` of each, the class runs the faster one from then on."""
        eager_times, compiled_times = self._times.setdefault(shape, ([], []))
        eager = len(eager_times) < len(compiled_times)
        compilations = _STATS.compilations
        started = time.perf_counter()
        out = self._eager(layers, *inputs) if eager else self._compiled(layers, inputs)
        seconds = time.perf_counter() - started
        if self._failed or _STATS.compilations != compilations:
            return out  # a compilation's call (or a failed one): not a sample
        (eager_times if eager else compiled_times).append(seconds)
        if len(eager_times) >= _TRIALS and len(compiled_times) >= _TRIALS:
            eager_ms = statistics.median(eager_times) * 1e3
            compiled_ms = statistics.median(compiled_times) * 1e3
            pays = compiled_ms <= eager_ms
            self._compiled_pays[shape] = pays
            if not pays:
                _STATS.add_eager_choice()
            log.info(
                "compiled layers, %s: %.2f ms compiled, %.2f ms eager: %s from now on",
                _describe(shape),
                compiled_ms,
                eager_ms,
                "compiled" if pays else "eager",
            )
        return out

    def _compiled(self, layers: Any, inputs: tuple[Any, ...]) -> torch.Tensor:
        import torch._dynamo.exc as dynamo_exc

        try:
            out: torch.Tensor = self._function(layers, *inputs)
        except dynamo_exc.TorchDynamoException as e:
            # Raised while tracing or compiling, before the graph ran (nothing was written):
            # a missing C++ compiler, a backend that cannot build the graph. Serving goes on
            # eagerly, with the same outputs as model.compile off.
            self._failed.append(" ".join(str(e).split())[:300])
            _STATS.add_failure()
            log.warning(
                "torch.compile failed (%s: %s); this model's layers run eagerly from now on "
                "(model.compile=false does so from the start)",
                type(e).__name__,
                self._failed[0],
            )
            return self._eager(layers, *inputs)
        return out
