"""Which keys each layer of a model attends to, and the masks that say so in a ragged forward.

The engine hands the model its own 4-D masks (:mod:`osd.decode.kv_cache`), so transformers does
not build them, and whatever transformers would have done per layer must be done here: a
*sliding-window* layer (Mistral, Gemma 2/3's local layers, gpt-oss's alternate layers, Cohere 2,
Qwen2 with ``use_sliding_window``, Phi-3) lets a query at position q see keys q-w+1..q; a
*chunked* layer (Llama 4) sees the keys of its own chunk of c positions; a full layer sees every
earlier key. Semantics follow ``transformers.masking_utils`` (``sliding_window_overlay``:
``kv > q - w``; ``chunked_overlay``: ``kv // c == q // c``, positions being absolute here).

Models that mix layer kinds (a config with ``layer_types``) take one mask per kind, as a dict
keyed by the kind's name (the ``causal_mask_mapping`` of transformers 5); models without
``layer_types`` use one mask for every layer, windowed when ``config.sliding_window`` is set.

What the engine cannot serve exactly is refused when the models load (:class:`UnsupportedModel`):
recurrent, state-space or linear-attention layers (their state is not a KV cache a row can be
cut back in), cross-attention, encoder-decoders, and layer kinds this module does not know.
Soft-capping of attention scores and final logits needs nothing here: it is inside the model's
attention function and head, which the engine calls as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "AttentionLayout",
    "UnsupportedModel",
    "attention_layout",
    "layout_masks",
    "text_config",
]

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"

# Model types whose layers keep a recurrent or state-space state instead of (or beside) a KV
# cache: a rejected draft token cannot be taken back out of such a state by cutting a length.
_RECURRENT = {
    "bamba": "Mamba-2 state-space layers",
    "falcon_h1": "Mamba-2 state-space layers",
    "falcon_mamba": "Mamba state-space layers",
    "granitemoehybrid": "Mamba-2 state-space layers",
    "jamba": "Mamba state-space layers",
    "lfm2": "short convolution layers",
    "lfm2_moe": "short convolution layers",
    "mamba": "Mamba state-space layers",
    "mamba2": "Mamba-2 state-space layers",
    "minimax": "lightning (linear) attention layers",
    "nemotron_h": "Mamba-2 state-space layers",
    "qwen3_next": "gated DeltaNet linear-attention layers",
    "recurrent_gemma": "RG-LRU recurrent layers",
    "rwkv": "RWKV recurrent layers",
    "xlstm": "xLSTM recurrent layers",
    "zamba": "Mamba state-space layers",
    "zamba2": "Mamba-2 state-space layers",
}


class UnsupportedModel(ValueError):
    """A model the engine cannot serve exactly; the message names the class and the feature."""


@dataclass(frozen=True)
class AttentionLayout:
    """The attention pattern of a model's layers.

    Attributes:
        windows: kind -> window (sliding) or chunk (chunked) in positions, None for full; one
            entry per kind the model's layers use.
        by_kind: the model takes a dict of masks keyed by kind (else one mask, of the only kind).
        spans: per layer, how many positions back its queries reach (the window or chunk; None:
            all); empty when every layer is full. The slot cache keeps only that many (and a
            forward's worth) for such a layer.
    """

    windows: dict[str, int | None]
    by_kind: bool
    spans: tuple[int | None, ...] = ()

    @staticmethod
    def full() -> AttentionLayout:
        return AttentionLayout({FULL: None}, by_kind=False)

    @property
    def max_window(self) -> int | None:
        """The widest window or chunk of any layer (None when every layer is full)."""
        sizes = [w for w in self.windows.values() if w is not None]
        return max(sizes) if sizes else None


def attention_layout(model: Any) -> AttentionLayout:
    """The layout of a loaded Hugging Face causal LM (not a peft wrapper).

    Raises:
        UnsupportedModel: the model has a layer the engine cannot serve exactly.
    """
    top = model.config
    # A model of text and images (Gemma 3 and 4, Mistral 3) keeps its decoder's layout in its
    # text config; what the engine serves is that decoder.
    config = text_config(top)
    name = type(model).__name__
    model_type = getattr(config, "model_type", "")
    if model_type in _RECURRENT:
        raise UnsupportedModel(
            f"{name} has {_RECURRENT[model_type]}, which osd cannot serve exactly"
        )
    if any(
        getattr(c, "is_encoder_decoder", False) or getattr(c, "add_cross_attention", False)
        for c in (top, config)
    ):
        raise UnsupportedModel(f"{name} has cross-attention, which osd cannot serve")
    if getattr(config, "cross_attention_layers", None):
        raise UnsupportedModel(f"{name} has cross-attention layers, which osd cannot serve")
    if getattr(config, "alibi", False) or model_type == "bloom":
        raise UnsupportedModel(
            f"{name} has ALiBi position biases, which osd's attention masks do not carry"
        )
    if "local" in (getattr(config, "attention_layers", None) or ()):
        # GPT-Neo: its local layers cut their band from the last query positions of the keys,
        # which a batch's shorter rows are not (their windows shift: not the model's output).
        raise UnsupportedModel(
            f"{name} has local attention layers that assume every row ends at the last key, "
            "which osd's batches of rows of different lengths break"
        )
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) is not False:
            num_layers = getattr(config, "num_hidden_layers", 0) or 0
            return AttentionLayout({SLIDING: int(window)}, False, (int(window),) * num_layers)
        return AttentionLayout.full()
    kinds = set(layer_types)
    unknown = sorted(kinds - {FULL, SLIDING, CHUNKED})
    if unknown:
        raise UnsupportedModel(
            f"{name} has layers of kind {', '.join(unknown)}, which osd cannot serve exactly "
            "(it serves full, sliding-window and chunked attention)"
        )
    windows = {kind: _window(config, kind, name) for kind in sorted(kinds)}
    if len(kinds) == 1 and FULL in kinds:
        return AttentionLayout(windows, by_kind=False)
    spans = tuple(windows[kind] for kind in layer_types)
    return AttentionLayout(windows, by_kind=len(kinds) > 1, spans=spans)


def text_config(config: Any) -> Any:
    """The config of a model's text decoder: ``config`` itself, or a model of text and images'
    (Gemma 3 and 4) text config, where its layers' layout and its context are declared."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


# Where configs declare their context, in the order they are read.
_CONTEXT_FIELDS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length")


def context_length(config: Any) -> int | None:
    """The most positions a sequence may hold: the config's declared maximum (MPT names it
    ``max_seq_len``), and with LongRoPE at most its ``original_max_position_embeddings``:
    past that, transformers switches every position of the sequence to the long factors and
    recomputes its whole cache (Phi-3's ``prepare_inputs_for_generation``), and it picks the
    factors per forward from the longest row, which a cache kept across steps and rows of
    different lengths cannot follow exactly. None: the config declares none."""
    config = text_config(config)
    declared = next(
        (v for v in (getattr(config, n, None) for n in _CONTEXT_FIELDS) if isinstance(v, int)),
        None,
    )
    original = _longrope_original(config)
    if original is not None:
        return original if declared is None else min(declared, original)
    return declared


def _longrope_original(config: Any) -> int | None:
    """``original_max_position_embeddings`` where some layer's RoPE is LongRoPE, else None."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return None
    nested = [v for v in rope.values() if isinstance(v, dict)]  # per layer kind (Gemma 3's)
    for params in nested or [rope]:
        if (params.get("rope_type") or params.get("type")) == "longrope":
            original = params.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            return int(original) if original else None
    return None


def _window(config: Any, kind: str, name: str) -> int | None:
    if kind == FULL:
        return None
    field = "sliding_window" if kind == SLIDING else "attention_chunk_size"
    size = getattr(config, field, None)
    if not isinstance(size, int) or size < 1:
        raise UnsupportedModel(f"{name} has {kind} layers but no {field} in its config")
    return size


def layout_masks(
    layout: AttentionLayout,
    query_pos: torch.Tensor,
    visible: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive mask(s) a model takes, per ``layout``.

    Args:
        query_pos: (B, T) absolute position of each query.
        visible: (B, T, S) causal visibility: key position s is visible to the query (s <= q,
            and the key belongs to the row); key index s is the absolute position s.
        dtype: the model's dtype.

    Returns:
        (B, 1, T, S) additive mask, or a dict of them keyed by layer kind.
    """
    masks: dict[str, torch.Tensor] = {}
    for kind, size in layout.windows.items():
        seen = visible
        if size is not None:
            keys = torch.arange(visible.shape[-1], device=visible.device).view(1, 1, -1)  # (1,1,S)
            queries = query_pos.unsqueeze(-1)  # (B, T, 1)
            if kind == SLIDING:
                seen = visible & (keys > queries - size)
            else:  # chunked
                seen = visible & (keys // size == queries // size)
        mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
        masks[kind] = mask.masked_fill_(~seen, torch.finfo(dtype).min).unsqueeze(1)
    if layout.by_kind:
        return masks
    return next(iter(masks.values()))
