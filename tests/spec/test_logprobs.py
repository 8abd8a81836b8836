"""Logprobs of emitted tokens equal the target alone's, for every method, in a mixed batch."""

from __future__ import annotations

import pytest
import torch

from osd import SpeculativeDecoder
from osd.spec.loop import BatchedEngine
from osd.spec.scheduler import BatchLimits

PROMPTS = [[3, 5, 7, 9], [10, 11, 12, 13, 14, 15], [42], [1, 2, 3, 4, 5, 6, 7, 8]]

# (method, k, temperature, logprobs, extra options): asking and not asking rows share steps.
ROWS = [
    ("block", 4, 0.0, 3, {}),
    ("token", 2, 1.0, 0, {"frequency_penalty": 0.5}),
    ("spectr", 3, 0.8, 5, {"top_k": 10, "num_drafts": 3}),
    ("none", 4, 1.0, 20, {"logit_bias": {7: 3.0}}),
    ("block", 3, 1.0, None, {}),
    ("token", "auto", 0.0, 1, {"stop": ["j"]}),
    ("spectr", 4, 1.0, None, {"num_drafts": 2}),
    ("block", 6, 0.7, 2, {"top_p": 0.9, "stop": ["ab"]}),
]


@pytest.fixture(scope="module")
def decoder(target_model, lora_draft, tokenizer):
    return SpeculativeDecoder(target_model, lora_draft, tokenizer)


def target_logprobs(target_model, prompt, token_ids):
    """Log-softmax of the target alone over prompt + generated tokens: (T, V) per token."""
    ids = torch.tensor([prompt + token_ids])
    with torch.no_grad():
        logits = target_model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


def check_logprobs(target_model, prompt, result, num_top):
    expected = target_logprobs(target_model, prompt, result.token_ids)  # (T, V)
    assert len(result.logprobs) == len(result.token_ids) > 0
    got = torch.tensor([entry.logprob for entry in result.logprobs])
    want = expected.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for t, entry in enumerate(result.logprobs):
        assert len(entry.top) == num_top
        if num_top:
            values, ids = expected[t].topk(num_top)
            assert [i for i, _ in entry.top] == ids.tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in entry.top]), values, atol=1e-4, rtol=0
            )


def test_logprobs_of_every_method_equal_the_target_alone_in_a_mixed_batch(decoder, target_model):
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=8, kv_slots=16))
    try:
        handles = []
        for i, (method, k, temperature, logprobs, extra) in enumerate(ROWS):
            request = decoder.prepare(
                PROMPTS[i % len(PROMPTS)],
                max_tokens=24,
                temperature=temperature,
                seed=100 + i,
                method=method,
                num_spec_tokens=k,
                adapter="code" if i % 2 else None,
                stop_token_ids=[],
                logprobs=logprobs,
                **extra,
            )
            handles.append(engine.submit(request))
        chunks = [list(handle) for handle in handles]
        results = [handle.result() for handle in handles]
    finally:
        engine.close()
    assert sum(r.stats.accepted for r in results) > 0  # speculation really emitted several
    for i, (row, result, row_chunks) in enumerate(zip(ROWS, results, chunks, strict=True)):
        method, logprobs = row[0], row[3]
        if logprobs is None:
            assert result.logprobs is None
            assert all(chunk.logprobs is None for chunk in row_chunks)
            continue
        check_logprobs(target_model, PROMPTS[i % len(PROMPTS)], result, logprobs)
        # Each chunk carries the logprobs of its own tokens.
        for chunk in row_chunks:
            assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids)
        assert [e for c in row_chunks for e in c.logprobs] == result.logprobs, method


@pytest.mark.parametrize("method", ["token", "block", "spectr", "none"])
def test_logprobs_of_a_batch_of_one_and_a_stop_string_cut(decoder, target_model, method):
    prompt = PROMPTS[1]
    result = decoder.generate(
        prompt, max_tokens=30, seed=5, method=method, num_spec_tokens=5, logprobs=4, stop=["c"]
    )
    check_logprobs(target_model, prompt, result, 4)


def test_logprobs_out_of_range_are_value_errors(decoder):
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="logprobs"):
            decoder.prepare(PROMPTS[0], logprobs=bad)
