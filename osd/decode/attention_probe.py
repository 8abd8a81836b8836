"""A check at load time that the engine's cached forward of a model is the model's own forward.

The engine never lets transformers build masks or caches (:mod:`osd.decode.kv_cache`), so a model
whose layers attend in a way :mod:`osd.decode.attention` does not know of would be served
approximately without anyone noticing. Before a model serves, a random sequence well past its
widest window runs through a slot cache in the pieces decoding makes (two ragged rows, a
prefill chunk, single tokens, multi-token verification chunks, a rollback and a rewrite), and
its logits are compared with one plain forward of the whole sequence (transformers' own masks,
no cache). A difference beyond the dtype's rounding refuses the model, naming its class.
"""

from __future__ import annotations

from typing import Any

import torch

from osd.decode.attention import UnsupportedModel
from osd.decode.kv_cache import SlotKVCache, plan_forward
from osd.devices import to_device
from osd.threads import torch_single_threaded

__all__ = ["check_cached_forward", "cached_forward_error"]

# Relative logit error (max |cached - plain| / max |plain|) allowed per dtype: the two paths
# sum in different orders (chunk shapes differ). Measured on the family matrix's random models:
# at most ~1e-6 in float32 and ~1e-2 in bfloat16; a mask that sees past a window of 8 in a
# 40-token sequence gives 0.1-1.
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_LOW_PRECISION_TOLERANCE = 6e-2

# Tokens each row appends per forward after its prefill chunk: decode-like pieces (1) and
# verification-like ones (k + 1), cycled; row 0 is cut back by 2 positions once (a rejection).
_PIECES = (1, 3, 1, 5, 2)
_PREFILL = (6, 11)


def cached_forward_error(lm: Any, length: int | None = None, seed: int = 0) -> float:
    """Max relative logit difference between the slot-cache path and a plain forward.

    Args:
        lm: a :class:`osd.decode.models.CausalLM`.
        length: tokens of the longer row; default: 24 past the widest window (32 without one),
            within the model's context.
        seed: seeds the random tokens.
    """
    window = lm.attention.max_window or 8
    length = length or window + 24
    if lm.max_positions:
        length = min(length, lm.max_positions)
    gen = torch.Generator().manual_seed(seed)
    rows = [
        torch.randint(0, lm.vocab_size, (n,), generator=gen).tolist()
        for n in (length, max(2, length - 7))
    ]
    device, dtype = lm.device, next(lm.model.parameters()).dtype
    # Windowed layers keep a ring of window + the widest piece, so the probe wraps them too.
    cache = SlotKVCache(2, length, lm.attention.spans, max_forward=max(_PREFILL))
    cached = [torch.zeros(0, lm.vocab_size, device=device) for _ in rows]  # (done, V) per row
    done, step = [0, 0], 0
    with torch.no_grad():
        while True:
            if step == 3 and done[0] > 2:  # a rejection: row 0 cuts back 2 positions
                done[0] -= 2
                cached[0] = cached[0][: done[0]]
            active = [b for b in (0, 1) if done[b] < len(rows[b])]
            if not active:
                break
            sizes = [_PREFILL[b] if step == 0 else _PIECES[step % len(_PIECES)] for b in active]
            pieces = [rows[b][done[b] : done[b] + n] for b, n in zip(active, sizes, strict=True)]
            width = max(len(p) for p in pieces)
            columns = torch.tensor(
                [
                    [done[b] for b in active],
                    [width - len(p) for p in pieces],
                    [len(p) for p in pieces],
                ]
            )
            plan = plan_forward(
                input_ids=to_device(
                    torch.tensor([[0] * (width - len(p)) + p for p in pieces]), device
                ),
                start=to_device(columns[0], device),
                left=to_device(columns[1], device),
                real=to_device(columns[2], device),
                own_slot=to_device(torch.tensor(active), device),
                base_slot=to_device(torch.tensor(active), device),
                prefix_len=to_device(torch.zeros(len(active), dtype=torch.int64), device),
                trash_slot=cache.trash_slot,
                dtype=dtype,
                layout=lm.attention,
            )
            logits = lm.run(plan, cache, num_logits=width).float()  # (B, width, V)
            for i, (b, piece) in enumerate(zip(active, pieces, strict=True)):
                cached[b] = torch.cat([cached[b], logits[i, width - len(piece) :]])
                done[b] += len(piece)
            step += 1
        error = 0.0
        for b in (0, 1):
            ids = to_device(torch.tensor([rows[b]]), device)
            plain = lm.plain_logits(ids)[0].float()  # (T, V)
            ours = cached[b]
            scale = float(plain.abs().max().clamp_min(1e-6))
            error = max(error, float((ours - plain).abs().max()) / scale)
    return error


def check_cached_forward(lm: Any, name: str) -> None:
    """Raises :class:`UnsupportedModel` if the cached forward of ``lm`` is not its own.

    Args:
        lm: a :class:`osd.decode.models.CausalLM`.
        name: what the model is to the user (``"target"``, ``"draft"``).
    """
    dtype = next(lm.model.parameters()).dtype
    tolerance = _TOLERANCE.get(dtype, _LOW_PRECISION_TOLERANCE)
    model_class = type(getattr(lm.model, "get_base_model", lambda: lm.model)()).__name__
    try:
        with torch_single_threaded():  # not beside the decode loop's team (osd.threads)
            error = cached_forward_error(lm)
    except (RuntimeError, TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        raise UnsupportedModel(
            f"the {name} model {model_class} cannot run on osd's KV cache ({exc!r:.200})"
        ) from exc
    if error > tolerance:
        raise UnsupportedModel(
            f"the {name} model {model_class} decoded through osd's KV cache differs from its own "
            f"forward (relative logit error {error:.2g} > {tolerance:g}; attention "
            f"{lm.attention.windows}): it has a layer or attention pattern osd does not serve "
            "exactly"
        )
