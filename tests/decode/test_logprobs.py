"""Logprobs of emitted tokens equal the target alone's, for every method, in a mixed batch."""

from __future__ import annotations

import pytest
import torch

from osd import SpeculativeDecoder
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits

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


def check_prompt_logprobs(target_model, prompt, entries, num_top):
    """Entry i (i >= 1) is the target alone's log-softmax after prompt[:i], at prompt[i]."""
    assert len(entries) == len(prompt) and entries[0] is None
    if len(prompt) == 1:
        return
    with torch.no_grad():
        logits = target_model(torch.tensor([prompt])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, dim=-1)  # (L - 1, V)
    want = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    got = torch.tensor([entry.logprob for entry in entries[1:]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    values, ids = expected.topk(num_top, dim=-1) if num_top else (None, None)
    for t, entry in enumerate(entries[1:]):
        assert len(entry.top) == num_top
        if num_top:
            assert [i for i, _ in entry.top] == ids[t].tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in entry.top]), values[t], atol=1e-4, rtol=0
            )


LONG_PROMPT = [(7 * i + 3) % 60 + 2 for i in range(23)]


@pytest.mark.parametrize("budget", [5, 4096])  # 5: the prompts' prefill runs in chunks
def test_prompt_logprobs_equal_the_target_alone_across_prefill_chunks(
    decoder, target_model, budget
):
    # Rows asking (for different numbers of alternatives) and not share the prefill and steps.
    asks = [3, None, 0, 5, None]
    prompts = [LONG_PROMPT, PROMPTS[1], PROMPTS[2], LONG_PROMPT[:9], PROMPTS[3]]
    engine = BatchedEngine(
        decoder, BatchLimits(max_num_seqs=8, kv_slots=16, max_num_batched_tokens=budget)
    )
    try:
        handles = [
            engine.submit(
                decoder.prepare(
                    prompt,
                    max_tokens=6,
                    seed=i,
                    method=("block", "token", "none", "spectr", "block")[i],
                    prompt_logprobs=n,
                    logprobs=n,
                )
            )
            for i, (prompt, n) in enumerate(zip(prompts, asks, strict=True))
        ]
        chunks = [list(handle) for handle in handles]
        results = [handle.result() for handle in handles]
    finally:
        engine.close()
    for prompt, n, row_chunks, result in zip(prompts, asks, chunks, results, strict=True):
        if n is None:
            assert result.prompt_logprobs is None
            assert all(chunk.prompt_logprobs is None for chunk in row_chunks)
            continue
        check_prompt_logprobs(target_model, prompt, result.prompt_logprobs, n)
        # The first chunk carries them, the others do not; generation is unchanged.
        assert row_chunks[0].prompt_logprobs == result.prompt_logprobs
        assert all(chunk.prompt_logprobs is None for chunk in row_chunks[1:])
        check_logprobs(target_model, prompt, result, n)


@pytest.mark.parametrize("method", ["block", "none"])
def test_max_tokens_0_scores_the_prompt_alone(decoder, target_model, method):
    result = decoder.generate(LONG_PROMPT, max_tokens=0, method=method, prompt_logprobs=2)
    assert result.token_ids == [] and result.text == "" and result.finish_reason == "length"
    assert result.log is None  # nothing generated: no record
    check_prompt_logprobs(target_model, LONG_PROMPT, result.prompt_logprobs, 2)
    single = decoder.generate([5], max_tokens=0, prompt_logprobs=1)
    assert single.prompt_logprobs == [None]


def test_prompt_logprobs_out_of_range_are_value_errors(decoder):
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            decoder.prepare(PROMPTS[0], prompt_logprobs=bad)
    with pytest.raises(ValueError, match="max_tokens"):
        decoder.prepare(PROMPTS[0], max_tokens=-1)
