"""How much memory a replica's KV caches may take: vLLM's ``gpu_memory_utilization``.

The replica may fill ``utilization`` of its device's memory (all of it: weights, activations,
caches, and whatever else already holds memory there, as vLLM counts it). What is in use once
the models are loaded, and the peak of the largest forward the decode loop runs (a prefill
chunk, measured on CUDA), come off; the rest is the KV budget
(:func:`osd.decode.scheduler.kv_slots_for_memory` turns it into slots). On the CPU the device
memory is the machine's: its total and what is available now.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch

from osd.decode.kv_cache import SlotKVCache, plan_one_row

__all__ = ["forward_peak_bytes", "kv_budget_bytes"]


def kv_budget_bytes(device: torch.device, utilization: float, reserve_bytes: int = 0) -> int:
    """Bytes left for KV caches when the replica may fill ``utilization`` of the device.

    Args:
        device: the models' device.
        utilization: in (0, 1].
        reserve_bytes: activations of the largest forward (:func:`forward_peak_bytes`).
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free
    else:
        memory = psutil.virtual_memory()
        total, in_use = memory.total, memory.total - memory.available
    return max(0, int(utilization * total) - in_use - reserve_bytes)


def forward_peak_bytes(lm: Any, num_tokens: int) -> int:
    """Peak memory of one forward of ``num_tokens`` new tokens through ``lm`` (a
    :class:`osd.decode.models.CausalLM`) on CUDA, its one-sequence cache included; 0 elsewhere."""
    device = lm.device
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    cache = SlotKVCache(num_slots=1, max_len=num_tokens)
    dtype = next(lm.model.parameters()).dtype
    plan = plan_one_row(num_tokens, cache.trash_slot, dtype, lm.attention, device)
    with torch.no_grad():
        lm.run(plan, cache, num_logits=1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache, plan
    torch.cuda.empty_cache()
    return int(peak)
