"""Loading Hugging Face causal LMs and running them one step at a time with a KV cache.

This is the only module of the engine that knows transformers' and peft's calling conventions
(the ``cache`` keyword of transformers >= 5.2x, ``past_key_values`` before it; peft's per-call
``adapter_names``), so the decode loop stays readable.

peft's own per-call ``adapter_names`` is not thread-safe: for each call it registers forward
pre-hooks on the shared LoRA layers, so two threads decoding with different adapters at once
each run with whichever hook came last (measured: 64 of 180 concurrent calls used another
thread's adapter). Outputs stay exact (verification), but acceptance falls. Here every LoRA
layer gets one permanent pre-hook that reads the adapters from a thread-local, set around each
call.

Mixed-adapter batches (each row its own adapter, as S-LoRA and punica serve them): plain LoRA
linear layers compute ``base(x) + scale * B(A(x))`` per group of rows sharing an adapter with
the groups' index tensors made once per forward, instead of peft's mixed-batch path, which
rebuilds the groups in Python in every layer (measured on the demo draft: the LoRA adapter cost
0.76 ms of a 1.54 ms forward through peft). Layers peft treats specially (merged, DoRA and
other variants, fan-in-fan-out, embeddings) keep peft's path.

A forward whose rows all run one adapter (or all none), which is most draft forwards, skips
all of that: it runs a lean forward whose LoRA layers are merged into plain weights for that
adapter (:func:`osd.decode.lean_forward.lean_forward_for`, ``merged``), made on its first use
and kept for the last ``merged_limit`` adapters used (each costs a copy of the weights its
adapter touches). Measured on the demo draft with a LoRA adapter on every layer, embeddings and
head: 1.01 -> 0.43 ms a forward at one row, 2.30 -> 0.84 ms at 16 (``docs/batched_engine.md``).
A peft adapter's weights never change under its name (a replica loads each version under a name
of its own), so a merged forward stays right until its adapter is deleted; any change to the
loaded adapters drops them all.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
)

from osd.decode.attention import AttentionLayout, attention_layout, context_length, text_config
from osd.decode.compiled_forward import FEW_TOKENS, CompiledModel
from osd.decode.kv_cache import (
    ForwardPlan,
    SlotKVCache,
    kept_positions,
    plan_one_row,
    plan_zero_rows,
)
from osd.decode.lean_forward import LeanForward, lean_forward_for
from osd.devices import to_device
from osd.threads import torch_single_threaded

logger = logging.getLogger(__name__)

__all__ = [
    "BASE_ADAPTER",
    "CausalLM",
    "added_token_ids",
    "auto_model_class",
    "load_causal_lm",
    "load_tokenizer",
    "special_token_ids",
]

# peft's name for "no adapter" in a mixed-adapter batch.
BASE_ADAPTER = "__base__"

# This thread's adapters for the current call: .adapter_names (one per row) and .groups
# ((adapter, rows or None for every row) per adapter other than the base).
_selected = threading.local()


def _row_groups(names: list[str], device: torch.device) -> list[tuple[str, torch.Tensor | None]]:
    rows: dict[str, list[int]] = {}
    for position, name in enumerate(names):
        rows.setdefault(name, []).append(position)
    groups: list[tuple[str, torch.Tensor | None]] = []
    for name, members in rows.items():
        if name == BASE_ADAPTER:
            continue
        index = None if len(members) == len(names) else to_device(torch.tensor(members), device)
        groups.append((name, index))
    return groups


def _grouped_lora_forward(layer: Any) -> Callable[..., torch.Tensor]:
    """A forward for one peft ``lora.Linear`` that applies each row group's adapter directly."""
    peft_forward = layer.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        groups = getattr(_selected, "groups", None)
        if (
            groups is None
            or args
            or layer.merged
            or layer.disable_adapters
            or getattr(layer, "fan_in_fan_out", False)
            or any(name in getattr(layer, "lora_variant", {}) for name, _ in groups)
        ):
            return peft_forward(x, *args, **kwargs)
        kwargs.pop("adapter_names", None)
        result = layer.base_layer(x, **kwargs)
        for name, rows in groups:
            if name not in layer.lora_A:
                continue
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            inputs = x if rows is None else x.index_select(0, rows)
            delta = torch.nn.functional.linear(inputs.to(lora_a.weight.dtype), lora_a.weight)
            delta = torch.nn.functional.linear(delta, lora_b.weight, lora_b.bias)
            delta = (delta * layer.scaling[name]).to(result.dtype)
            result = result + delta if rows is None else result.index_add(0, rows, delta)
        return result

    return forward


def _inject_adapter_names(
    module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    names = getattr(_selected, "adapter_names", None)
    if names is not None:
        kwargs["adapter_names"] = names
    return args, kwargs


def _hook_lora_layers(model: Any) -> None:
    """Gives every LoRA layer of a peft model the thread-local adapter pre-hook, once."""
    if getattr(model, "_osd_adapter_hooks", False):  # another CausalLM wraps it already
        return
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer) and isinstance(module, torch.nn.Module):
            module.register_forward_pre_hook(_inject_adapter_names, with_kwargs=True)
            if type(module) is LoraLinear:
                module.forward = _grouped_lora_forward(module)  # type: ignore[method-assign]
    model._osd_adapter_hooks = True


@contextlib.contextmanager
def _adapters_for_this_thread(names: list[str], device: torch.device) -> Iterator[None]:
    previous = getattr(_selected, "adapter_names", None), getattr(_selected, "groups", None)
    _selected.adapter_names = names
    _selected.groups = _row_groups(names, device)
    try:
        yield
    finally:
        _selected.adapter_names, _selected.groups = previous


def auto_model_class(config: Any) -> Any:
    """The auto class that builds a model of ``config``: ``AutoModelForCausalLM``, or for a
    model of text and images that transformers builds no causal LM of (Mistral 3, Qwen2.5-VL,
    Qwen3-VL), ``AutoModelForImageTextToText``, whose forward takes text alone as a causal LM's
    does (the engine serves the text; the load check holds it to its own forward)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    kind = type(config)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_causal_lm(
    model: PreTrainedModel | str, *, device: str | None = None, dtype: str | None = None
) -> PreTrainedModel:
    """Returns a model in eval mode, loading it from a local path or hub id if given a string.

    Args:
        model: a loaded model (used as is, moved only if ``device`` is given) or a path/hub id.
        device: e.g. ``"cuda"`` or ``"cpu"``; ``None`` keeps a loaded model where it is and
            loads a path on CUDA when available.
        dtype: e.g. ``"bfloat16"``; ``None`` keeps the checkpoint's dtype.
    """
    torch_dtype = getattr(torch, dtype) if dtype else None
    if isinstance(model, str):
        kwargs: dict[str, Any] = {"dtype": torch_dtype} if torch_dtype else {}
        auto = auto_model_class(AutoConfig.from_pretrained(model))
        loaded: PreTrainedModel = auto.from_pretrained(model, **kwargs)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    else:
        loaded = model.to(torch_dtype) if torch_dtype is not None else model
    if device is not None:
        loaded = loaded.to(device)  # type: ignore[arg-type]  # transformers types .to oddly
    return loaded.eval()


def load_tokenizer(source: Any) -> Any:
    """Loads the tokenizer saved beside a model path or hub id; None if there is none."""
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special added tokens by their text (``{"<|call|>": 200012}``): the ones
    decoding skips unless ``skip_special_tokens`` is off. Empty for a tokenizer without any,
    or None."""
    return added_token_ids(tokenizer, only_special=True)


def added_token_ids(tokenizer: Any, only_special: bool = False) -> dict[str, int]:
    """Every added token of the tokenizer by its text, special or not (Qwen3's ``</think>``,
    DeepSeek's ``<｜tool▁sep｜>`` are not): llguidance reads each as a token of its own that
    grammar text cannot spell, so a grammar names them by id (``<[151668]>``)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {
        token.content: i
        for i, token in added.items()
        if not only_special or getattr(token, "special", False)
    }


def _base_model(model: PreTrainedModel) -> PreTrainedModel:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


# Tokens a row of compile_graphs' forwards: one, a few, many (FEW_TOKENS's either side), after
# this many positions (a context of 1 runs eagerly).
_GRAPH_TOKENS = (1, 4, FEW_TOKENS + 2)
_GRAPH_START = 3


def _scratch_cache() -> SlotKVCache:
    """Eight slots (compile_graphs' widest forward's rows), storage growing from its least (a
    forward never fills it exactly: that step runs eagerly)."""
    return SlotKVCache(num_slots=8, max_len=_GRAPH_START + FEW_TOKENS + 8)


@dataclass
class CausalLM:
    """A causal LM called with explicit KV caches, optional LoRA adapter and logits slicing.

    Attributes:
        model: the Hugging Face model (or a peft model wrapping one).
        vocab_size: logits columns used (may be below the padded embedding size).
        attention: which keys each layer attends to (sliding windows, chunks); a model the
            engine cannot serve exactly is refused here
            (:class:`osd.decode.attention.UnsupportedModel`).
        lean: run slot-cache forwards through :mod:`osd.decode.lean_forward` where the model's
            family has one (False: transformers' own forward, for debugging).
        compile: the lean forward's in-place layers through ``torch.compile``
            (:mod:`osd.decode.compiled_forward`), the merged forwards' too (one compiled
            function for them all).
        cuda_graphs: on CUDA, the lean forward's in-place layers (compiled or not) replayed
            from CUDA graphs (:mod:`osd.decode.cuda_graphs`), merged draft forwards' too.
        merged_limit: merged lean forwards a LoRA model keeps (module docstring); 0: none,
            every forward of a LoRA model runs its adapters per row.
    """

    model: PreTrainedModel
    vocab_size: int
    # Entered around every forward; a server that adds and removes LoRA adapters while
    # decoding makes it a shared (read) lock so module dicts never change mid-forward.
    guard: Callable[[], AbstractContextManager[Any]] = field(default=contextlib.nullcontext)
    lean: bool = True
    compile: bool = False
    cuda_graphs: bool = False
    merged_limit: int = 4

    attention: AttentionLayout = field(init=False)

    def __post_init__(self) -> None:
        self.attention = attention_layout(_base_model(self.model))
        config = text_config(_base_model(self.model).config)
        declared = getattr(config, "max_position_embeddings", None)
        if declared and self.max_positions and self.max_positions < declared:
            logger.warning(
                "%s: LongRoPE, served up to its original %d positions of %d (past them "
                "transformers recomputes the whole cache with the long factors)",
                type(_base_model(self.model)).__name__,
                self.max_positions,
                declared,
            )
        params = inspect.signature(_base_model(self.model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._slices_logits = "logits_to_keep" in params
        self._has_lora = hasattr(self.model, "peft_config")
        if self._has_lora:
            _hook_lora_layers(self.model)
        # The lean forward looks its layers up once; a peft model's LoRA layers appear when an
        # adapter is added, so it is looked up again whenever the adapters change.
        self._lean: tuple[tuple[str, ...], LeanForward | None] | None = None
        # adapter (None: the base) -> its merged lean forward (None: it cannot be merged),
        # least recently used first; emptied with ``_lean`` when the adapters change.
        self._merged: dict[str | None, LeanForward | None] = {}
        # The compiled layers every lean forward of this model shares (its merged ones too),
        # kept across adapter changes: a swapped-in adapter compiles nothing.
        self._compiled = CompiledModel() if self.compile else None

    @property
    def uses_lean_forward(self) -> bool:
        """Whether slot-cache forwards run through the lean forward (module docstring of
        :mod:`osd.decode.lean_forward`)."""
        return self._lean_forward() is not None

    @property
    def packs(self) -> bool:
        """Whether a forward may compute only its rows' real tokens (a plan's ``packed``):
        the lean forward runs it, and no LoRA layer groups rows by the batch dimension."""
        return not self._has_lora and self.uses_lean_forward

    def _lean_forward(self) -> LeanForward | None:
        if not self.lean:
            return None
        names = self.adapter_names
        if self._lean is None or self._lean[0] != names:
            forward = lean_forward_for(
                _base_model(self.model), self._compiled, cuda_graphs=self.cuda_graphs
            )
            self._lean = (names, forward)
            self._merged.clear()
        return self._lean[1]

    def _merged_forward(self, adapters: list[str | None] | None) -> LeanForward | None:
        """The merged lean forward for a forward whose rows all run one adapter; None where
        they do not, where the model has no LoRA layers, or where they cannot be merged. Call
        after :meth:`_lean_forward` (which drops them when the adapters change)."""
        if not self._has_lora or self.merged_limit <= 0:
            return None
        chosen = set(adapters) if adapters else {None}
        if len(chosen) != 1:
            return None
        adapter = chosen.pop()
        if adapter in self._merged:
            self._merged[adapter] = self._merged.pop(adapter)  # most recently used
        else:
            if len(self._merged) >= self.merged_limit:
                del self._merged[next(iter(self._merged))]
            self._merged[adapter] = lean_forward_for(
                _base_model(self.model),
                self._compiled,
                merged=True,
                adapter=adapter,
                cuda_graphs=self.cuda_graphs,
            )
        return self._merged[adapter]

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """LoRA adapters loaded now (a replica adds and removes versions while serving)."""
        return tuple(getattr(self.model, "peft_config", {}) or ())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int | None:
        return context_length(self.model.config)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=_base_model(self.model).config)

    def check_adapter(self, adapter: str | None) -> None:
        """Raises ValueError if ``adapter`` is not a LoRA adapter of this model."""
        if adapter is not None and adapter not in self.adapter_names:
            raise ValueError(
                f"unknown adapter {adapter!r}; this draft has {list(self.adapter_names) or 'none'}"
            )

    def logits(
        self,
        input_ids: torch.Tensor,
        cache: DynamicCache,
        *,
        num_logits: int,
        adapter: str | None = None,
    ) -> torch.Tensor:
        """Runs new tokens through the model, appending them to ``cache``.

        Args:
            input_ids: (B, T) tokens after those already in the cache.
            cache: the KV cache, extended in place by T positions.
            num_logits: logits wanted for the last ``num_logits`` positions.
            adapter: LoRA adapter name for a peft model; None is the base model.

        Returns:
            (B, num_logits, vocab_size) logits.
        """
        adapters = [adapter] * input_ids.shape[0]
        return self._forward(input_ids, cache, num_logits, adapters)

    def run(
        self,
        plan: ForwardPlan,
        cache: SlotKVCache,
        *,
        num_logits: int,
        adapters: list[str | None] | None = None,
    ) -> torch.Tensor:
        """One batched forward over ragged rows, reading and writing KV per ``plan``.

        Args:
            plan: inputs, positions, KV slots and mask of every row (:mod:`osd.decode.kv_cache`).
            cache: the model's slot cache.
            num_logits: logits wanted for the last ``num_logits`` columns.
            adapters: LoRA adapter per row (None: the base model) for a peft model; rows with
                different adapters share the forward (grouped per adapter, module docstring).

        Returns:
            (B, num_logits, vocab_size) logits (0 at a packed plan's right padding).
        """
        if plan.packed is not None and not self.packs:
            raise ValueError("a packed plan needs a model that packs (CausalLM.packs)")
        cache.bind(plan)
        if self.lean:
            with self.guard():  # adapters change between forwards, never during one
                lean = self._lean_forward()
                merged = None if lean is None else self._merged_forward(adapters)
                if lean is not None:
                    per_row = self._selection(adapters, plan.input_ids) if merged is None else None
                    with per_row or contextlib.nullcontext():
                        logits = (merged or lean)(
                            plan.input_ids,
                            plan.position_ids,
                            plan.attention_mask,
                            cache,
                            num_logits,
                            plan.packed,
                        )
                    return logits[..., : self.vocab_size]
        return self._forward(
            plan.input_ids,
            cache,
            num_logits,
            adapters or [None] * plan.input_ids.shape[0],
            attention_mask=plan.attention_mask,
            position_ids=plan.position_ids,
        )

    def kv_bytes_per_slot(self, max_len: int, max_forward: int | None = None) -> int:
        """Bytes of KV cache one sequence of ``max_len`` positions takes in this model, all
        layers, windowed layers keeping their window and ``max_forward`` positions when given
        (:class:`osd.decode.kv_cache.SlotKVCache`); measured with a one-token forward, so any
        layer shapes and dtypes count as they are."""
        cache = SlotKVCache(num_slots=1, max_len=1)
        dtype = next(self.model.parameters()).dtype
        plan = plan_one_row(1, cache.trash_slot, dtype, self.attention, self.device)
        with torch.no_grad(), torch_single_threaded():  # beside the decode loop (osd.threads)
            self.run(plan, cache, num_logits=1)
        per_layer = cache.bytes_per_layer_position()
        kept = kept_positions(self.attention.spans, max_len, max_forward or max_len)
        kept += [max_len] * (len(per_layer) - len(kept))
        return sum(b * n for b, n in zip(per_layer, kept, strict=False))

    def compile_graphs(self) -> int:
        """With ``compile``, one forward of each shape its compiled layers have a graph for
        (:mod:`osd.decode.compiled_forward`: one row or several, one token a row, a few or
        many, and where the model packs, several rows of a few computing only their real
        ones), over a scratch cache: served steps then compile nothing, whatever shapes the
        warm-up's requests happened to reach (a draft back on 16 rows after steps without it
        reads a few tokens a row, all rows alike: served, that graph compiled on the first
        concurrent requests, 4.5 s from inductor's cache). Returns the forwards run (0: not
        compiled)."""
        if self._compiled is None or not self.lean:
            return 0
        dtype = next(self.model.parameters()).dtype
        shapes = [([tokens] * rows, False) for rows in (1, 2) for tokens in _GRAPH_TOKENS]
        if self.packs:  # verify steps of different widths, their attention whole or split
            # (several wide rows: looked-up drafts beside rows of a token); a prompt read in a
            # decode step (one wide row)
            few = 2 * _GRAPH_TOKENS[1]
            shapes += [
                ([_GRAPH_TOKENS[1], 1], True),
                ([1] * 6 + [few, few], True),
                ([1, 1, _GRAPH_TOKENS[2]], True),
            ]
        cache = _scratch_cache()
        with torch.inference_mode():  # as the decode loop's steps run (dynamo guards on it)
            # The first forward allocates the cache's storage (eager: nothing to read in place).
            self.run(self._zero_rows([_GRAPH_START] * 2, 0, cache, dtype), cache, num_logits=1)
            for lengths, packed in shapes:
                plan = self._zero_rows(lengths, _GRAPH_START, cache, dtype, packed)
                self.run(plan, cache, num_logits=1)
        return len(shapes)

    def _zero_rows(
        self,
        lengths: list[int],
        start: int,
        cache: SlotKVCache,
        dtype: torch.dtype,
        packed: bool = False,
    ) -> ForwardPlan:
        return plan_zero_rows(
            lengths,
            start,
            cache.trash_slot,
            dtype,
            self.attention,
            self.device,
            packed,
            narrow=FEW_TOKENS if packed else 0,
        )

    def plain_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The base model's (no adapter) own forward, with transformers' masks and no cache.

        Args:
            input_ids: (B, T) tokens.

        Returns:
            (B, T, vocab_size) logits.
        """
        disabled: AbstractContextManager[Any] = contextlib.nullcontext()
        if self._has_lora:
            disabled = self.model.disable_adapter()  # type: ignore[operator]  # peft's
        with self.guard(), disabled:
            logits = _base_model(self.model)(input_ids=input_ids, use_cache=False).logits
        return logits[..., : self.vocab_size]

    def _selection(
        self, adapters: list[str | None] | None, input_ids: torch.Tensor
    ) -> AbstractContextManager[Any]:
        """Selects each row's LoRA adapter for this thread's next forward (a no-op without
        LoRA)."""
        if not self._has_lora:
            return contextlib.nullcontext()
        names = [name or BASE_ADAPTER for name in adapters or [None] * input_ids.shape[0]]
        return _adapters_for_this_thread(names, input_ids.device)

    def _forward(
        self,
        input_ids: torch.Tensor,
        cache: Any,
        num_logits: int,
        adapters: list[str | None],
        **extra: Any,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True, **extra}
        if self._slices_logits:
            kwargs["logits_to_keep"] = num_logits
        with self.guard(), self._selection(adapters, input_ids):
            # The wrapped HF model runs the LoRA layers (their hooks choose the adapters); peft's
            # own forward would also look up its "active adapter", which a replica deletes and
            # replaces while serving, so it is left out of the decode path.
            logits = _base_model(self.model)(input_ids=input_ids, **kwargs).logits
        return logits[:, -num_logits:, : self.vocab_size]
