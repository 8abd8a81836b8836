"""The draft's LoRA adapter is chosen per call, and per thread: a replica decodes requests that
use different adapters on one peft model at the same time."""

from __future__ import annotations

import threading

import torch

from osd.models import CausalLM
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
