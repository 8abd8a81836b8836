"""Speculative decoding with osd in a few lines (tiny random models: runs anywhere, offline)."""

from osd import SpeculativeDecoder
from osd.buffer.record import Record
from osd.testing import char_tokenizer, noisy_copy, tiny_llama, with_lora_adapters

# Any Hugging Face causal LM pair sharing a vocabulary works: objects, local paths or hub ids,
# e.g. SpeculativeDecoder("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct",
#                         device="cuda", dtype="bfloat16").
target = tiny_llama(vocab_size=64, hidden_size=64, num_layers=2, seed=0, logit_scale=4.0)
draft = with_lora_adapters(noisy_copy(target, 0.1, seed=1), ["code", "sql"], seed=2)
engine = SpeculativeDecoder(target, draft, char_tokenizer())

result = engine.generate(
    "hello",
    max_tokens=40,
    temperature=0.8,
    top_p=0.95,
    seed=0,
    method="block",
    num_spec_tokens=4,
    adapter="code",
)
print(repr(result.text), result.finish_reason)
print(result.stats.as_dict())  # steps, drafted, accepted, acceptance_rate, mean_draft_length...

for chunk in engine.stream("hello", max_tokens=12, temperature=0, method="token"):
    print(chunk.token_ids, repr(chunk.text))  # tokens as soon as they are verified

record = Record.from_generation(
    result.log, request_id="req-1", domain="code"
)  # what a replica logs
print(record.num_generated, record.top_m, len(record.pack()), "bytes")
