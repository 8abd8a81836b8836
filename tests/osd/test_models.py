"""The draft's LoRA adapter is chosen per call, and per thread: a replica decodes requests that
use different adapters on one peft model at the same time."""

from __future__ import annotations

import threading

import torch

from osd.decode.kv_cache import ForwardPlan, SlotKVCache
from osd.decode.models import CausalLM
from osd.testing import tiny_llama, with_lora_adapters


def test_concurrent_calls_with_different_adapters_each_get_their_own():
    model = with_lora_adapters(
        tiny_llama(vocab_size=64, hidden_size=32, num_layers=2, seed=0), ["a", "b"], seed=1
    )
    lm = CausalLM(model, vocab_size=64)
    inputs = torch.arange(2, 34).reshape(1, 32)

    def logits(adapter: str | None) -> torch.Tensor:
        with torch.no_grad():
            return lm.logits(inputs, lm.new_cache(), num_logits=32, adapter=adapter)

    expected = {name: logits(name) for name in ("a", "b", None)}
    assert not torch.allclose(expected["a"], expected["b"])
    wrong: list[str] = []
    start = threading.Barrier(3)

    def worker(adapter: str | None) -> None:
        start.wait()
        for _ in range(60):
            if not torch.allclose(logits(adapter), expected[adapter], atol=1e-5):
                wrong.append(str(adapter))

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("a", "b", None)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong, f"{len(wrong)} of 180 calls ran with another thread's adapter: {wrong[:6]}"


def test_mixed_adapter_batch_equals_each_row_through_peft_alone():
    """Rows of one forward with different adapters (and the base) get exactly what peft computes
    for each row alone with its adapter active."""
    model = with_lora_adapters(
        tiny_llama(vocab_size=64, hidden_size=32, num_layers=2, seed=0), ["a", "b"], seed=1
    )
    lm = CausalLM(model, vocab_size=64)
    inputs = torch.arange(2, 26).reshape(4, 6)
    adapters = ["a", None, "b", "a"]
    with torch.no_grad():
        cache = SlotKVCache(4, 16)
        plan = ForwardPlan.make_dummy(batch=4, length=6, trash=cache.trash_slot)
        plan.input_ids = inputs
        mixed = lm.run(plan, cache, num_logits=6, adapters=adapters)
        for row, adapter in enumerate(adapters):
            if adapter is None:
                with model.disable_adapter():
                    alone = model(input_ids=inputs[row : row + 1]).logits
            else:
                model.set_adapter(adapter)
                alone = model(input_ids=inputs[row : row + 1]).logits
            torch.testing.assert_close(mixed[row], alone[0], atol=1e-5, rtol=0)
