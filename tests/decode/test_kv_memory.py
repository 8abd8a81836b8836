"""KV slots from a memory budget (vLLM's gpu_memory_utilization), measured per model."""

from __future__ import annotations

import pytest
import torch

from osd import SpeculativeDecoder
from osd.decode.loop import BatchedEngine
from osd.decode.models import CausalLM
from osd.decode.scheduler import BatchLimits, kv_slots_for_memory
from osd.device_memory import forward_peak_bytes, kv_budget_bytes
from tests.families import build_family


@pytest.mark.parametrize(
    ("budget", "per_slot", "max_slots", "slots"),
    [
        (10_000, 1_000, 100, 9),  # one slot of the ten takes the padding writes
        (10_999, 1_000, 100, 9),
        (10_000, 1_000, 4, 4),  # no more than the batch can use
        (2_000, 1_000, 100, 1),
    ],
)
def test_slots_that_fit_a_budget(budget, per_slot, max_slots, slots):
    assert kv_slots_for_memory(budget, per_slot, max_slots) == slots


def test_a_budget_below_one_sequence_is_refused_with_the_sizes():
    with pytest.raises(ValueError, match="holds no sequence .* lower serve.max_model_len"):
        kv_slots_for_memory(1_500 * 2**20, 1_000 * 2**20, 8)


@pytest.mark.parametrize(
    ("family", "layers", "kv_heads", "head_dim"),
    [("llama3", 3, 2, 8), ("qwen3", 3, 2, 8), ("gpt2", 3, 4, 8), ("gemma2", 3, 2, 8)],
)
def test_bytes_per_slot_are_the_models_keys_and_values(family, layers, kv_heads, head_dim):
    model = build_family(family, 0)
    expected = 100 * layers * 2 * kv_heads * head_dim * 4  # 100 positions, keys and values
    assert CausalLM(model, 64).kv_bytes_per_slot(100) == expected
    half = CausalLM(build_family(family, 0).to(torch.bfloat16), 64)
    assert half.kv_bytes_per_slot(100) == expected // 2


def test_windowed_layers_count_their_window_and_one_forward():
    # Gemma 2 here: layers 0 and 2 slide over 8 positions, layer 1 is full.
    lm = CausalLM(build_family("gemma2", 0), 64)
    per_layer_position = 2 * 2 * 8 * 4
    full = lm.kv_bytes_per_slot(1000)
    assert full == 3 * 1000 * per_layer_position
    kept = lm.kv_bytes_per_slot(1000, max_forward=17)  # windows keep 8 + 17 - 1 positions
    assert kept == (1000 + 2 * 24) * per_layer_position


def test_the_loop_takes_as_many_slots_as_the_budget_holds(target_model, lora_draft):
    decoder = SpeculativeDecoder(target_model, lora_draft)
    per_slot = decoder.target.kv_bytes_per_slot(128) + decoder.draft.kv_bytes_per_slot(128)
    budget = per_slot * 6  # six slots of 128 positions: five rows and the trash slot
    engine = BatchedEngine(
        decoder, BatchLimits(max_num_seqs=8, max_model_len=128, kv_cache_memory_bytes=budget)
    )
    try:
        assert engine.limits.num_slots == 5
        handles = [
            engine.submit(decoder.prepare([3, 4, 5], max_tokens=20, temperature=0, method="token"))
            for _ in range(7)
        ]  # seven requests, five slots: two wait, none fails
        assert all(len(h.result().token_ids) == 20 for h in handles)
    finally:
        engine.close()
    # The budget's caches were allocated whole at the first forward: nothing grew while serving.
    for cache in (engine.pair.target_cache, engine.pair.draft_cache):
        assert cache.growths == 1  # the first forward's allocation, never again
        assert cache.bytes_per_layer_position() and all(k.shape[1] == 128 for k in cache._keys)
    unbudgeted = BatchedEngine(decoder, BatchLimits(max_num_seqs=2, max_model_len=128))
    try:
        unbudgeted.submit(decoder.prepare([3, 4, 5], max_tokens=4, temperature=0)).result()
    finally:
        unbudgeted.close()
    assert unbudgeted.pair.target_cache._keys[0].shape[1] < 128  # grows as rows need


def test_the_cpu_budget_is_a_share_of_the_machine_less_what_is_in_use():
    device = torch.device("cpu")
    assert kv_budget_bytes(device, 1.0) > 0
    assert kv_budget_bytes(device, 1.0, reserve_bytes=2**60) == 0  # the reserve comes off
    assert kv_budget_bytes(device, 0.01) < kv_budget_bytes(device, 1.0)
    assert forward_peak_bytes(CausalLM(build_family("llama3", 0), 64), 16) == 0  # CUDA only
    with pytest.raises(ValueError, match="utilization"):
        kv_budget_bytes(device, 1.5)


def test_a_forward_wider_than_the_rings_is_refused_not_served_inexactly():
    from osd.decode.kv_cache import SlotKVCache, plan_one_row

    ringed = SlotKVCache(2, 100, spans=[8, None], max_forward=4)
    assert ringed.kept == [11, 100]
    with pytest.raises(ValueError, match="writes 5 positions in one forward"):
        ringed.bind(plan_one_row(5, ringed.trash_slot, torch.float32, None, "cpu"))
    full = SlotKVCache(2, 100, spans=[None, None], max_forward=4)  # no ring: any width
    full.bind(plan_one_row(5, full.trash_slot, torch.float32, None, "cpu"))
