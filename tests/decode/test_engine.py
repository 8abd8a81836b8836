"""The engine through real (tiny) Hugging Face models: greedy equality, streaming, errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from osd import SpeculativeDecoder
from osd.buffer.record import Record
from osd.testing import tiny_llama

PROMPTS = [[3, 5, 7, 9], [10, 11, 12, 13, 14, 15, 16, 17], [42]]
METHODS = ["token", "block", "spectr"]


@pytest.fixture(scope="module")
def greedy_references(target_model):
    outputs = []
    for prompt in PROMPTS:
        generated = target_model.generate(
            torch.tensor([prompt]), max_new_tokens=100, do_sample=False, min_new_tokens=100
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def engine(target_model, lora_draft, tokenizer):
    return SpeculativeDecoder(target_model, lora_draft, tokenizer)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("adapter", [None, "code", "sql"])
def test_greedy_output_equals_target_greedy_generate(engine, greedy_references, method, adapter):
    accepted = 0
    for prompt, reference in zip(PROMPTS, greedy_references, strict=True):
        result = engine.generate(
            prompt,
            max_tokens=100,
            temperature=0,
            method=method,
            adapter=adapter,
            num_spec_tokens=4,
            stop_token_ids=[],
        )
        assert result.token_ids == reference
        accepted += result.stats.accepted
    assert accepted > 0  # the caches were cropped after partial acceptances, not only rejections


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_unrelated_draft_equals_target(
    target_model, unrelated_draft, greedy_references, method
):
    engine = SpeculativeDecoder(target_model, unrelated_draft)
    result = engine.generate(PROMPTS[0], max_tokens=100, temperature=0, method=method)
    assert result.token_ids == greedy_references[0]


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 9e-6])
def test_a_temperature_too_small_for_float32_is_greedy(engine, greedy_references, temperature):
    # Logits / 1e-38 overflow to inf and the probabilities to NaN; a NaN ratio made the
    # verifier accept every drafted token.
    result = engine.generate(
        PROMPTS[0], max_tokens=100, temperature=temperature, seed=1, stop_token_ids=[]
    )
    assert result.token_ids == greedy_references[0]
    assert Record.from_generation(result.log, request_id="r").temperature == 0.0


def test_stream_yields_the_same_tokens_as_generate(engine):
    kwargs = dict(
        max_tokens=40,
        temperature=1.0,
        seed=7,
        method="block",
        num_spec_tokens=3,
        stop_token_ids=[],
    )
    chunks = list(engine.stream(PROMPTS[1], **kwargs))
    result = engine.generate(PROMPTS[1], **kwargs)
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text
    assert chunks[-1].finish_reason == result.finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize("method", METHODS)
def test_same_seed_and_fixed_k_give_same_output(engine, method):
    # With k "auto" (the default) a seed fixes the output distribution, not the text: which k
    # each step used depends on the controller's statistics from earlier requests.
    kwargs = dict(max_tokens=30, seed=3, method=method, num_spec_tokens=3, num_drafts=3)
    first = engine.generate(PROMPTS[0], **kwargs)
    second = engine.generate(PROMPTS[0], **kwargs)
    assert first.token_ids == second.token_ids


@pytest.mark.parametrize("method", METHODS)
def test_log_data_covers_every_generated_position(engine, target_model, method):
    result = engine.generate(
        PROMPTS[1],
        max_tokens=25,
        seed=1,
        method=method,
        num_spec_tokens=3,
        num_drafts=2,
        stop_token_ids=[],
    )
    log, stats = result.log, result.stats
    n = len(result.token_ids)
    assert n == stats.num_generated == 25
    assert log.token_ids.tolist() == PROMPTS[1] + result.token_ids
    assert log.target_top_ids.shape == log.target_top_probs.shape == (n, 32)
    assert log.target_top_ids.dtype == torch.int32 and log.target_top_probs.dtype == torch.float16
    assert int(log.num_drafted.sum()) == stats.drafted == log.draft_token_probs.numel()
    assert int(log.num_accepted.sum()) == stats.accepted
    assert len(log.num_drafted) == stats.steps
    # The logged rows are the target's own temperature-1 distribution at each position.
    full = torch.tensor([log.token_ids.tolist()])
    with torch.no_grad():
        logits = target_model(full).logits[0, len(PROMPTS[1]) - 1 : -1]
    expected = torch.softmax(logits, dim=-1).topk(32, dim=-1)
    torch.testing.assert_close(log.target_top_probs.float(), expected.values, atol=2e-3, rtol=0)
    assert bool((log.draft_token_probs > 0).all())


def test_log_false_collects_nothing(engine):
    assert engine.generate(PROMPTS[0], max_tokens=5, log=False).log is None


def test_text_prompt_and_stop_string(engine, tokenizer):
    result = engine.generate("ab", max_tokens=60, temperature=0)
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    stop = result.text[10:12]
    stopped = engine.generate("ab", max_tokens=60, temperature=0, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == result.text[: result.text.find(stop)]
    streamed = "".join(c.text for c in engine.stream("ab", max_tokens=60, temperature=0, stop=stop))
    assert streamed == stopped.text


def test_stops_at_eos_token(engine):
    reference = engine.generate(PROMPTS[0], max_tokens=30, temperature=0, stop_token_ids=[])
    eos = reference.token_ids[5]
    result = engine.generate(PROMPTS[0], max_tokens=30, temperature=0, stop_token_ids=[eos])
    assert result.token_ids == reference.token_ids[: reference.token_ids.index(eos) + 1]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": []}, "empty"),
        ({"prompt": ""}, "empty"),
        ({"num_spec_tokens": 0}, "num_spec_tokens"),
        ({"num_drafts": 0, "method": "spectr"}, "num_drafts"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": -1}, "max_tokens"),  # 0 is allowed: prompt scoring (echo)
        ({"method": "beam"}, "method"),
        ({"adapter": "nope"}, "unknown adapter"),
        ({"prompt": [1] * 600}, "context"),
        ({"prompt": [64]}, "out of range"),
    ],
)
def test_bad_input_raises_clear_value_error(engine, kwargs, message):
    prompt = kwargs.pop("prompt", PROMPTS[0])
    with pytest.raises(ValueError, match=message):
        engine.generate(prompt, **kwargs)


def test_different_vocabularies_are_refused(target_model):
    other = tiny_llama(vocab_size=80, hidden_size=32, num_layers=1, seed=5)
    with pytest.raises(ValueError, match="different vocabularies"):
        SpeculativeDecoder(target_model, other)


def test_generation_stops_at_the_context_limit(tokenizer):
    target = tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=6, max_positions=20)
    draft = tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=7, max_positions=20)
    result = SpeculativeDecoder(target, draft).generate([1] * 15, max_tokens=50, seed=0)
    assert len(result.token_ids) == 5
    assert result.finish_reason == "length"


def test_log_packs_into_a_record_without_text(engine):

    result = engine.generate("ab", max_tokens=20, seed=2, adapter="sql", method="spectr")
    record = Record.from_generation(
        result.log, request_id="req-1", domain="code", adapter_version=3
    )
    again = Record.unpack(record.pack())
    assert again.generated_ids.tolist() == result.token_ids
    assert (again.adapter_name, again.adapter_version, again.method) == ("sql", 3, "spectr")
    assert again.num_drafts == 2 and again.seed == result.log.request.seed
    assert result.text.encode() not in record.pack() or not result.text


def test_stream_result_and_cancel(engine):
    stream = engine.stream(PROMPTS[0], max_tokens=50, seed=4, stop_token_ids=[])
    first = next(stream)
    stream.cancel()
    result = stream.result()
    assert result.token_ids == first.token_ids
    assert result.log.target_top_ids.shape[0] == len(first.token_ids)


def test_method_none_is_plain_target_decoding(engine, greedy_references):
    result = engine.generate(
        PROMPTS[0], max_tokens=100, temperature=0, method="none", stop_token_ids=[]
    )
    assert result.token_ids == greedy_references[0]
    assert result.stats.drafted == 0 and result.stats.steps == 100
    record = Record.from_generation(result.log, request_id="plain")
    assert record.method == "none" and record.num_generated == 100


def test_cancel_from_another_thread_while_decoding_stops_the_stream(engine):
    stream = engine.stream(PROMPTS[0], max_tokens=400, seed=5, stop_token_ids=[])
    outcome: dict = {}

    def decode() -> None:
        try:
            outcome["result"] = stream.result()
        except Exception as exc:  # noqa: BLE001 - asserted on below
            outcome["error"] = exc

    thread = threading.Thread(target=decode)
    thread.start()
    while not stream.num_generated and thread.is_alive():
        time.sleep(0.001)
    for _ in range(50):  # e.g. the event loop, when the client goes away mid-step
        stream.cancel()
    thread.join(timeout=60)
    assert "error" not in outcome, outcome.get("error")
    assert 0 < len(outcome["result"].token_ids) < 400


def test_per_step_counts_are_in_the_stats_with_or_without_logging(engine):
    kwargs = dict(max_tokens=30, seed=1, num_spec_tokens=4, stop_token_ids=[])
    logged = engine.generate(PROMPTS[0], **kwargs)
    unlogged = engine.generate(PROMPTS[0], **kwargs, log=False)
    assert unlogged.log is None
    assert unlogged.stats.draft_lengths == logged.log.num_drafted.tolist()
    assert unlogged.stats.accepted_lengths == logged.log.num_accepted.tolist()
    assert sum(unlogged.stats.draft_lengths) == unlogged.stats.drafted > 0
    assert unlogged.stats.draft_lengths[0] == 0  # the first token came with the prefill
    assert 0 < unlogged.stats.decode_seconds == unlogged.stats.as_dict()["decode_seconds"]
