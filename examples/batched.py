"""Many requests decoded together by one batched loop, as a replica runs them."""

from osd import SpeculativeDecoder
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits
from osd.testing import char_tokenizer, noisy_copy, tiny_llama, with_lora_adapters

target = tiny_llama(vocab_size=64, hidden_size=64, num_layers=2, seed=0, logit_scale=4.0)
draft = with_lora_adapters(noisy_copy(target, 0.1, seed=1), ["code", "sql"], seed=2)
engine = SpeculativeDecoder(target, draft, char_tokenizer())
batched = BatchedEngine(engine, BatchLimits(max_num_seqs=16))

handles = [
    batched.submit(engine.prepare(prompt, max_tokens=24, temperature=0, adapter=adapter))
    for prompt, adapter in [("hello", None), ("select", "sql"), ("def f", "code")]
]
for chunk in handles[0]:  # a handle yields its request's chunks as the loop verifies them
    print(chunk.token_ids)
for handle in handles:
    result = handle.result()  # waits for the end; handle.cancel() frees the row instead
    print(repr(result.text), result.stats.acceptance_rate)
print("mean batch", batched.stats.mean_batch)
batched.close()
