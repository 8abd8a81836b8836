"""A lean forward for Llama-shaped decoders over the slot cache: the same arithmetic as
transformers' modules, without their per-call overhead.

At serving sizes a decode step's forward is mostly fixed cost per operation, not FLOPs: on the
demo target (12 layers, hidden 128) transformers' forward takes about 9 ms a token on one CPU thread
running modules, hooks, keyword plumbing, mask checks and dtype round trips around ~85 small
matmuls (``docs/batched_engine.md``, "The lean forward"). This forward runs the same weights
through the same operations in the same order (RMSNorm in float32, rotary embeddings from the
model's own ``rotary_emb`` so every RoPE scaling type is honoured, SDPA with the plan's
additive masks, SiLU-gated MLP), layer by layer in one Python function, and reads and writes
the slot cache exactly as the transformers path does.

Which models: the decoder families whose layers are exactly Llama's shape (``_FAMILIES``:
Llama, Mistral, Qwen2, Qwen3 with its per-head q/k norms), with SiLU MLPs and RMSNorm, whatever
their attention layout (full, sliding windows, mixed: the plan's mask of each layer's kind).
Anything else (Gemma's offset norms and soft-caps, Phi-3's fused projections, MoE, a model with
an unexpected module) keeps transformers' forward: :func:`lean_forward_for` returns None. LoRA
layers (a peft-wrapped draft) are called as modules, so their per-row adapter groups
(:mod:`osd.decode.models`) apply unchanged; plain linear layers are called as ``F.linear`` on their
weights. A forward whose rows all run one adapter (or none) can instead take a *merged* lean
forward (``merged=True``): each LoRA layer becomes one plain weight, its base weight plus that
adapter's delta (peft's ``get_delta_weight``), so the draft costs what a plain draft costs.

Exactness does not rest on this module matching transformers bit for bit: verification is
exact for whatever distribution the target's forward computes, and every sampled token comes
from this same forward. The load check (:mod:`osd.decode.attention_probe`) still compares the
cached forward with the model's own plain forward at load, so a lean forward that drifted from
transformers is refused before it serves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from osd.decode.attention import FULL
from osd.decode.compiled_forward import FEW_TOKENS, CompiledModel
from osd.decode.cuda_graphs import GraphedLayers
from osd.decode.kv_cache import Packing

__all__ = ["LeanForward", "lean_forward_for"]

# model_type -> has per-head q/k RMSNorm (Qwen3).
_FAMILIES = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True}

_Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Merge:
    """Every row of a forward runs one LoRA ``adapter`` (None: the base weights alone)."""

    adapter: str | None


def _plain_weight(module: Any, kind: type, merge: _Merge | None) -> Any:
    """The weight a layer of ``kind`` (``nn.Linear`` or ``nn.Embedding``) computes with, or None
    where it must be called as its module: a plain layer's own weight; a peft LoRA layer's base
    weight plus ``merge.adapter``'s delta when merging (a new tensor; the base weight itself
    where the adapter is None or does not touch the layer). Layers peft treats specially (an
    adapter merged into the base already, DoRA and other variants, LoRA biases) are not merged."""
    if _is_exactly(module, kind):
        return module.weight
    base: Any = getattr(module, "base_layer", None)
    if merge is None or not _is_exactly(base, kind) or getattr(module, "merged", False):
        return None
    name = merge.adapter
    if name is None or name not in module.scaling:
        return base.weight
    if name in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(name):
        return None
    with torch.no_grad():  # a trainable adapter's delta must not keep its autograd graph
        return base.weight + module.get_delta_weight(name).to(base.weight.dtype)


def _is_exactly(module: Any, kind: type) -> bool:
    return type(module) is kind


def _linear(module: Any, relayout: bool = True, merge: _Merge | None = None) -> _Linear:
    """``F.linear`` on a plain linear layer's weights (laid out column-major on the CPU unless
    ``relayout`` is False: a head tied to the embedding, which reads it by rows), or on a LoRA
    layer's merged ones (``merge``); the module itself otherwise (LoRA, per row)."""
    weight = _plain_weight(module, torch.nn.Linear, merge)
    if weight is None:
        return module
    bias = getattr(module, "base_layer", module).bias
    if relayout and isinstance(weight, torch.nn.Parameter):
        _column_major_on_cpu(weight)
    elif relayout:  # a merged weight: this forward's own tensor
        weight = _column_major(weight)
    return _Dense(weight, bias)


class _Dense:
    """``F.linear`` on one weight (and bias): a plain layer's, or a merged LoRA layer's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _embedding(module: Any, merge: _Merge | None = None) -> _Linear:
    """``F.embedding`` on a plain embedding's weights (or a LoRA embedding's merged ones); the
    module itself otherwise (a LoRA embedding: the distilled demo adapters train the embeddings
    too)."""
    weight = _plain_weight(module, torch.nn.Embedding, merge)
    if weight is None:
        return module
    return lambda ids: F.embedding(ids, weight)


def _column_major_on_cpu(weight: torch.Tensor) -> None:
    """Stores a CPU linear layer's (out, in) weight as the transpose of a contiguous (in, out)
    matrix, in place: same values, same parameter object, no extra memory.

    A decode step's matmuls on the CPU stream every weight from memory once per forward (the
    demo target's 85 weights are 11.7 MB, out of cache by the next forward); with the weight
    laid out (in, out) the BLAS reads it in the order it multiplies. Measured on those weights,
    one thread: 0.87 -> 0.65 ms a forward's matmuls at batch 1, 3.64 -> 2.90 ms at batch 16
    (``docs/batched_engine.md``). Sums come out in another order, so results may differ from
    the (out, in) layout in the last bits, for transformers' forward of the model as well (it
    reads the same parameter), and ``save_pretrained`` saves the same values. CUDA's GEMMs take
    either layout at the same speed: nothing changes there.
    """
    relaid = _column_major(weight.data)
    if relaid is not weight.data:
        weight.data = relaid


def _column_major(data: torch.Tensor) -> torch.Tensor:
    """A CPU matrix's values stored as the transpose of a contiguous matrix (``data`` itself
    where it already is, or is not on the CPU)."""
    if data.device.type != "cpu" or data.dim() != 2 or data.stride() == (1, data.shape[0]):
        return data
    return data.t().contiguous().t()


def _is_rms_norm(module: Any) -> bool:
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and getattr(module, "weight", None) is not None
        and not hasattr(module, "with_scale")  # Gemma-style offset norms
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, operation for operation (the casts only where the model is
    not float32: each is a dispatch even when it does nothing)."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x if dtype == torch.float32 else x.to(dtype))


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with the sign of rotate_half's negated half folded
    into ``signed_sin`` (sign flips are exact): eagerly a roll instead of two slices, a
    negation and a concatenation (one operation against four). Compiled, the halves swapped by
    a concatenation instead, the same values: inductor reads a roll's wrapped index one
    element at a time, and where it fuses the queries' rotation into the attention scores
    (:func:`_attend_by_products`) that gather ran once per key: the scores cost 1.4x."""
    half = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
    return x * cos + x.roll(half, dims=-1) * signed_sin


class _Layer:
    """One decoder layer's weights and callables, looked up once."""

    def __init__(self, layer: Any, kind: str, merge: _Merge | None = None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.kind = kind
        self.q, self.k, self.v, self.o = (
            _linear(attn.q_proj, merge=merge),
            _linear(attn.k_proj, merge=merge),
            _linear(attn.v_proj, merge=merge),
            _linear(attn.o_proj, merge=merge),
        )
        self.gate, self.up, self.down = (
            _linear(mlp.gate_proj, merge=merge),
            _linear(mlp.up_proj, merge=merge),
            _linear(mlp.down_proj, merge=merge),
        )
        self.norm1 = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.norm2 = (
            layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.variance_epsilon,
        )
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        self.q_norm = None if q_norm is None else (q_norm.weight, q_norm.variance_epsilon)
        self.k_norm = None if k_norm is None else (k_norm.weight, k_norm.variance_epsilon)
        callables = [self.q, self.k, self.v, self.o, self.gate, self.up, self.down]
        self.plain = not any(isinstance(c, torch.nn.Module) for c in callables)  # no LoRA call
        self.head_dim = int(attn.head_dim)
        self.gqa = int(attn.num_key_value_groups) > 1  # a bool: static when compiled
        self.scaling = float(attn.scaling)

    def signature(self) -> tuple[Any, ...]:
        """What a graph compiled over this layer depends on (:func:`layers_signature`)."""
        dense = [self.q, self.k, self.v, self.o, self.gate, self.up, self.down]
        tensors = [t for d in dense for t in (d.weight, d.bias)]  # type: ignore[attr-defined]
        norms = [n for n in (self.norm1, self.norm2, self.q_norm, self.k_norm)]
        tensors += [None if n is None else n[0] for n in norms]
        described = tuple(
            None if t is None else (tuple(t.shape), t.stride(), t.dtype, str(t.device))
            for t in tensors
        )
        epsilons = tuple(None if n is None else float(n[1]) for n in norms)
        return (self.kind, self.head_dim, self.gqa, self.scaling, epsilons, described)


def layers_signature(layers: list[_Layer]) -> tuple[Any, ...]:
    """Everything a graph compiled over ``layers`` takes as given: each weight's sizes,
    strides, dtype and device, and the constants (layer kinds, head size, grouped heads,
    scaling, norm epsilons). Forwards of one model with equal signatures share its compiled
    graphs (:class:`osd.decode.compiled_forward.CompiledModel`): the plain forward and every
    merged adapter's, whose merged weights are laid out as the base ones."""
    return tuple(layer.signature() for layer in layers)


def _attention_inputs(
    layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's queries, keys and values, (..., H, D) each, rotary applied."""
    x = _rms_norm(hidden, *layer.norm1)
    shape = (*hidden.shape[:-1], -1, layer.head_dim)
    q, k, v = layer.q(x).view(shape), layer.k(x).view(shape), layer.v(x).view(shape)
    if layer.q_norm is not None and layer.k_norm is not None:
        q, k = _rms_norm(q, *layer.q_norm), _rms_norm(k, *layer.k_norm)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _attend(
    layer: _Layer,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    products: bool = True,
) -> torch.Tensor:
    """(B, T, H, D) queries over (B, S, H_kv, D) keys and values, token-major as the slot cache
    keeps them -> (B, T, H, D): by products and sums where they pay
    (:func:`_products_pay`; never without ``products``), else SDPA."""
    if products and _products_pay(q, keys.shape[1]):
        return _attend_by_products(layer, q, keys, values, mask)
    return F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        scale=layer.scaling,
        enable_gqa=layer.gqa,
    ).transpose(1, 2)


def _attend_by_products(
    layer: _Layer,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """(B, T, H, D) queries over (B, S, H_kv, D) keys and values read where the slot cache
    keeps them (token-major) -> (B, T, H, D): SDPA's arithmetic as products and sums, for the
    compiled forward on the CPU at a few tokens a row (decode and verify steps), and the eager
    one at one token a row where the products are small (:func:`_products_pay`).

    Inductor fuses each of the two sums with its products into one pass over a row's keys,
    then one over its values, reading them in the order they are stored. PyTorch's CPU flash
    attention instead takes each (row, head) pair on its own, with a fixed cost of about 10 us
    a pair on the demo target at 100 keys, most of it waiting on memory: 16 rows' attention
    over 12 layers' caches (20 MB) ran at 5 GB/s where one pass streams at 21. Measured on the
    demo target's shapes, compiled, per layer with the query projection: 2.2x SDPA at 16 rows
    and 100 keys, 2.0x at 200, 1.7x at one row; 1.16x at 16 rows of 5 tokens
    (``docs/batched_engine.md``). Grouped-query heads share their key head's pass. Sums come
    in another order than SDPA's, so results differ in the last bits (as every compiled
    output does)."""
    batch, width, heads, dim = q.shape
    span, heads_kv = keys.shape[1], keys.shape[2]
    grouped = q.view(batch, width, 1, heads_kv, heads // heads_kv, dim)  # (B, T, 1, H_kv, G, D)
    scores = (grouped * keys[:, None, :, :, None]).sum(-1) * layer.scaling
    scores = scores + mask.reshape(batch, width, span, 1, 1)  # (B, T, S, H_kv, G)
    probs = torch.softmax(scores, dim=2)
    out = (probs.unsqueeze(-1) * values[:, None, :, :, None]).sum(2)
    return out.view(batch, width, heads, dim)


# The most tokens a row attends by products and sums when compiled: compiled_forward.FEW_TOKENS,
# a verify step's, not a prefill's, whose long rows SDPA's blocked matmuls take better.
# Eagerly, products and sums are tensors of their own (B x S x H x D elements each): they pay
# at one token a row from this many rows, up to this many elements (the demo target, one
# thread: 16 rows, 100-250 keys, the forward 10.4-10.9 -> 7.4-8.6 ms; 8 rows 6.9 -> 5.3-5.7;
# 4 rows and one row as SDPA, within noise).
_EAGER_PRODUCT_ROWS = 8
_EAGER_PRODUCT_ELEMENTS = 1 << 21


def _products_pay(q: torch.Tensor, span: int) -> bool:
    """Whether (B, T, H, D) queries over ``span`` keys attend by products and sums
    (:func:`_attend_by_products`) rather than SDPA; only on the CPU. Compiled: up to
    ``FEW_TOKENS`` tokens a row (a static choice for a size of 1; for wider
    rows the bound is one guard, so a graph of its own). Eagerly: one token a row, at least
    ``_EAGER_PRODUCT_ROWS`` rows, and products of at most ``_EAGER_PRODUCT_ELEMENTS`` elements
    (a large model's, or a long context's, stay with SDPA, whose per-pair cost they
    amortize)."""
    batch, width, heads, dim = q.shape
    if q.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():
        return width <= FEW_TOKENS
    return (
        width == 1
        and batch >= _EAGER_PRODUCT_ROWS
        and batch * span * heads * dim <= _EAGER_PRODUCT_ELEMENTS
    )


def _attend_packed(
    layer: _Layer,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor,
    split: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """A packed forward's attention: (N, H, D) queries of the real tokens at ``index`` of the
    (B, T) grid (B and T read off the (B, 1, T, S) ``mask``), over every row's (B, S, H_kv, D)
    keys and values -> (N, H x D).

    Without ``split`` the queries go back on the whole grid. With it (:class:`osd.decode.
    kv_cache.AttentionSplit`: the tail's columns as a size, the wide rows, each token's place
    in the two grids), on two: every row's last columns, attended as a decode or verify step's
    are, and the wide rows' columns before them (their keys copied out: a row or a few), by
    SDPA whatever their width, so that a compiled graph takes any head (one graph, not one
    for each side of ``FEW_TOKENS``)."""
    batch, width = mask.shape[0], mask.shape[2]
    if split is None:
        grid = _scattered(q, index, batch * width).view(batch, width, *q.shape[1:])
        return _attend(layer, grid, keys, values, mask).reshape(batch * width, -1)[index]
    tail_size, wide, places = split
    tail, rows = tail_size.shape[0], wide.shape[0]
    head = width - tail
    grids = _scattered(q, places, batch * tail + rows * head)
    tail_out = _attend(
        layer,
        grids[: batch * tail].view(batch, tail, *q.shape[1:]),
        keys,
        values,
        mask[:, :, head:],
    )
    head_out = _attend(
        layer,
        grids[batch * tail :].view(rows, head, *q.shape[1:]),
        keys.index_select(0, wide),
        values.index_select(0, wide),
        mask.index_select(0, wide)[:, :, :head],
        products=False,
    )
    outs = (tail_out.reshape(batch * tail, -1), head_out.reshape(rows * head, -1))
    return torch.cat(outs)[places]


def _after_attention(layer: _Layer, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The output projection and the MLP, each with its residual."""
    hidden = residual + layer.o(out)
    x = _rms_norm(hidden, *layer.norm2)
    return hidden + layer.down(F.silu(layer.gate(x)) * layer.up(x))


def _in_place_layers(
    layers: list[_Layer],
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    write_index: torch.Tensor,
    slots: torch.Tensor | None = None,
    first: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
    wide: torch.Tensor | None = None,
    places: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder layers over (B, T, hidden) when row b reads slot ``first + b`` of
    ``keys``/``values`` (each layer's whole (slots, capacity, H_kv, D) storage) in place and
    its new keys go to the flat ``write_index`` (:meth:`osd.decode.kv_cache.SlotKVCache.
    in_place_io`): tensors only, the function ``model.compile`` compiles. ``first``: the first
    row's slot as a size, :func:`first_slot_size` (None: slot 0). With ``slots`` (B,), row b
    reads slot ``slots[b]`` instead, by an index: the addresses a CUDA graph replays do not
    depend on the rows' slots (:mod:`osd.decode.cuda_graphs`). With ``packed`` (N,), the
    real tokens' places in the flattened (B, T) grid (:class:`osd.decode.kv_cache.Packing`),
    only they are computed: ``hidden`` is (N, hidden), ``cos``/``sin`` (N, 1, D),
    ``write_index`` theirs, and attention alone sees the grid (B and T read off ``mask``), or
    with ``tail`` (its columns as a size), ``wide`` and ``places`` two grids
    (:func:`_attend_packed`)."""
    batch, width = (mask.shape[0], mask.shape[2]) if packed is not None else hidden.shape[:2]
    kv_len = mask.shape[-1]
    start = 0 if first is None else first.shape[0] - _SLOT_SIZE_OFFSET
    split = None if tail is None or wide is None or places is None else (tail, wide, places)
    for index, layer in enumerate(layers):
        q, k, v = _attention_inputs(layer, hidden, cos, sin)
        stores = keys[index], values[index]
        for store, new in zip(stores, (k, v), strict=True):
            store.view(-1, *store.shape[2:]).index_copy_(0, write_index, new.flatten(0, -3))
        rows = [  # (B, S, H_kv, D) views in place, or copies of the indexed rows
            store[start : start + batch, :kv_len]
            if slots is None
            else store[:, :kv_len].index_select(0, slots)
            for store in stores
        ]
        if packed is not None:
            out = _attend_packed(layer, q, rows[0], rows[1], mask, packed, split)
        else:
            out = _attend(layer, q, rows[0], rows[1], mask).view(batch, width, -1)
        hidden = _after_attention(layer, hidden, out)
    return hidden


def _split_inputs(
    packed: Packing | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A packing's attention split as the layers take it (the tail's columns as a size)."""
    if packed is None or packed.split is None:
        return None
    split = packed.split
    return torch.empty(split.tail, 0, device=device), split.wide, split.index


def _scattered(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """(N, ...) ``values`` put at rows ``index`` of ``size`` rows of zeros: packed tokens' queries
    back on the (B x T) grid attention sees."""
    return values.new_zeros(size, *values.shape[1:]).index_copy_(0, index, values)


# A first slot s goes to compiled layers as a size of s + 2: never 0 or 1, which torch would
# compile graphs of their own for.
_SLOT_SIZE_OFFSET = 2


def first_slot_size(first: int, device: torch.device) -> torch.Tensor:
    """An empty tensor whose first size says the rows' first slot, for compiled layers.

    An int would be a constant of the graph (a graph for each first slot), and a view of the
    storage from that slot on an input with an offset of its own: graphs compiled for views
    at offset 0 (the rows from slot 0) and elsewhere differ, and on the demo target the
    latter's writes into the view cost 3x the whole forward (a step at one row 6.3 against
    2.2 ms)."""
    return torch.empty(first + _SLOT_SIZE_OFFSET, 0, device=device)


class LeanForward:
    """The lean forward of one Llama-shaped model (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        layer_kinds: list[str],
        compiled: CompiledModel | None = None,
        merge: _Merge | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        """``compiled``: the in-place layers through ``torch.compile``, as the model's other
        forwards of the same :func:`layers_signature` run them (:mod:`osd.decode.
        compiled_forward`), where every layer is plain (no LoRA, or merged). ``merge``:
        every LoRA layer merged for one adapter (:func:`lean_forward_for`). ``cuda_graphs``:
        the in-place layers (compiled or not) replayed from CUDA graphs
        (:mod:`osd.decode.cuda_graphs`) where every layer is plain and the model is on CUDA."""
        inner = model.model
        self.embed = _embedding(inner.embed_tokens, merge)
        self.rotary = inner.rotary_emb
        self.layers = [
            _Layer(layer, kind, merge)
            for layer, kind in zip(inner.layers, layer_kinds, strict=True)
        ]
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        head = model.lm_head
        tied = head.weight is getattr(inner.embed_tokens, "weight", None)
        # A LoRA head is called as its module (or merged: a weight of its own, not tied).
        self.head = _linear(head, relayout=not tied, merge=merge)
        self.plain = all(layer.plain for layer in self.layers) and not any(
            isinstance(c, torch.nn.Module) for c in (self.embed, self.head)
        )
        plain_layers = all(layer.plain for layer in self.layers)
        layers: Callable[..., torch.Tensor] = functools.partial(_in_place_layers, self.layers)
        self.in_place_layers = (
            compiled.layers(layers_signature(self.layers), _in_place_layers, self.layers)
            if compiled is not None and plain_layers
            else None
        )
        on_cuda = inner.norm.weight.device.type == "cuda"
        self.graphed_layers = (
            GraphedLayers(self.in_place_layers or layers)
            if cuda_graphs and plain_layers and on_cuda
            else None
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        masks: torch.Tensor | dict[str, torch.Tensor],
        cache: Any,
        num_logits: int,
        packed: Packing | None = None,
    ) -> torch.Tensor:
        """(B, T) ids -> (B, num_logits, V) logits of the last ``num_logits`` columns; keys and
        values go through ``cache.update_packed`` (a bound
        :class:`osd.decode.kv_cache.SlotKVCache`).

        Every position-wise operation (norms, projections, MLP, rotary) runs on the computed
        tokens: the (B, T) grid, or with ``packed`` only the real tokens as one (N, hidden)
        matrix, so padding costs no matmul; attention alone sees the (B, H, T, S) grid, with
        the packed queries scattered into it and the outputs gathered back. (LoRA layers group
        their rows by the batch dimension: a model with LoRA is not run packed.)
        """
        batch, width = input_ids.shape
        if packed is not None:
            input_ids = input_ids.reshape(-1)[packed.index]  # (N,)
            position_ids = position_ids.reshape(-1)[packed.index].unsqueeze(0)  # (1, N)
        hidden = self.embed(input_ids)  # (B, T, hidden) or (N, hidden)
        cos, sin = self.rotary(hidden, position_ids)  # (B, T, D) or (1, N, D)
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # rotate_half's signs
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (B, T, 1, D) or (1, N, 1, D)
        if packed is not None:
            cos, sin = cos[0], sin[0]  # (N, 1, D)
        # Compiled or graphed, every layer reading its rows in place takes plain tensors in and
        # out; the eager forward keeps the cache's own reads and writes (no per-step slicing).
        # Packed, a verify step's few tokens a row run compiled too, and so does a step with
        # one prompt read in it, its attention split (one wide row: osd.decode.loop takes one
        # a turn); a packed prefill's many tokens a row, split or not, stay eager.
        graphed = self.graphed_layers if packed is None else None
        wide_rows_apart = (
            packed is not None and packed.split is not None and len(packed.split.wide) == 1
        )
        compiled = (
            self.in_place_layers
            if packed is None or width <= FEW_TOKENS or wide_rows_apart
            else None
        )
        io = (
            cache.in_place_io(len(self.layers))
            if (graphed or compiled) is not None and not isinstance(masks, dict)
            else None
        )
        if io is not None and graphed is not None and not isinstance(masks, dict):
            keys, values, write_index, first = io
            hidden = graphed(hidden, cos, sin, masks, keys, values, write_index, first)
        elif io is not None and compiled is not None:
            keys, values, write_index, first = io
            hidden = compiled(
                hidden,
                cos,
                sin,
                masks,
                keys,
                values,
                write_index,
                None,
                first_slot_size(first, hidden.device),
                None if packed is None else packed.index,
                *(_split_inputs(packed, hidden.device) or ()),
            )
        else:
            hidden = self._layers_through_cache(
                hidden, cos, sin, masks, cache, packed, (batch, width)
            )
        if packed is None:
            hidden = hidden[:, -num_logits:]
            return self.head(_rms_norm(hidden, *self.norm))
        logits = self.head(_rms_norm(hidden[packed.logits_from], *self.norm))  # (M, V)
        out = logits.new_zeros(batch * num_logits, logits.shape[-1])
        return out.index_copy_(0, packed.logits_to, logits).view(batch, num_logits, -1)

    @property
    def compiled(self) -> bool:
        """Whether the in-place layers run compiled (``compiled`` and no LoRA layer)."""
        return self.in_place_layers is not None

    @property
    def graphed(self) -> bool:
        """Whether the in-place layers replay CUDA graphs (``cuda_graphs``, no LoRA layer, on
        CUDA)."""
        return self.graphed_layers is not None

    def _layers_through_cache(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: torch.Tensor | dict[str, torch.Tensor],
        cache: Any,
        packed: Packing | None,
        grid: tuple[int, int],
    ) -> torch.Tensor:
        """The decoder layers, their keys and values through ``cache.update_packed`` (any
        plan: packed, gathered, rings, mixed layer kinds); ``grid``: the (B, T) input's."""
        batch, width = grid
        split = _split_inputs(packed, hidden.device)
        for index, layer in enumerate(self.layers):
            mask = masks[layer.kind] if isinstance(masks, dict) else masks
            q, k, v = _attention_inputs(layer, hidden, cos, sin)
            heads_kv = k.shape[-2]
            keys, values = cache.update_packed(  # (B, H_kv, S, D)
                k.reshape(-1, heads_kv, layer.head_dim),
                v.reshape(-1, heads_kv, layer.head_dim),
                index,
            )
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
            if packed is None:
                q = q.view(batch, width, -1, layer.head_dim)
                out = _attend(layer, q, keys, values, mask).reshape(batch, width, -1)
            else:
                q = q.view(q.shape[0], -1, layer.head_dim)
                out = _attend_packed(layer, q, keys, values, mask, packed.index, split)
            hidden = _after_attention(layer, hidden, out)
        return hidden


def lean_forward_for(
    model: Any,
    compiled: CompiledModel | None = None,
    *,
    merged: bool = False,
    adapter: str | None = None,
    cuda_graphs: bool = False,
) -> LeanForward | None:
    """The lean forward of a loaded (unwrapped) Hugging Face causal LM, or None when its
    architecture is not one this module runs exactly like transformers does;
    ``compiled`` and ``cuda_graphs`` as :class:`LeanForward` takes them. ``merged``: a
    forward for rows that all run ``adapter`` (None: the base weights), every LoRA layer one
    plain weight; None also where some LoRA layer cannot be merged (:attr:`LeanForward.plain`
    is then True)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in _FAMILIES:
        return None
    if getattr(config, "hidden_act", None) != "silu":
        return None
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager", None):
        return None
    inner = getattr(model, "model", None)
    if inner is None or not all(
        hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")
    ):
        return None
    if not hasattr(model, "lm_head") or not _is_rms_norm(inner.norm):
        return None
    has_qk_norm = _FAMILIES[config.model_type]
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return None
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if not all(hasattr(attn, n) for n in names) or not all(
            hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")
        ):
            return None
        if not all(
            _is_rms_norm(getattr(layer, n, None))
            for n in ("input_layernorm", "post_attention_layernorm")
        ):
            return None
        if has_qk_norm and not (_is_rms_norm(attn.q_norm) and _is_rms_norm(attn.k_norm)):
            return None
    kinds = list(getattr(config, "layer_types", None) or [FULL] * len(inner.layers))
    if not merged:
        return LeanForward(model, kinds, compiled, cuda_graphs=cuda_graphs)
    forward = LeanForward(model, kinds, compiled, _Merge(adapter), cuda_graphs)
    return forward if forward.plain else None
