"""A stop string ends the answer at the token that completed it, whatever the method (issue 14).

A speculative step emits several tokens; those after the token that completed a stop string
were kept before (in most block runs), so ``token_ids`` and ``usage.completion_tokens`` depended
on the method. Here the tokenizer has multi-character tokens, so stop strings start and end
inside tokens, and every check detokenizes: the answer's tokens are the shortest prefix of the
unstopped generation whose text holds the stop string.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from osd import SpeculativeDecoder
from osd.buffer.record import Record
from osd.decode.generation import GenerationResult, TextAssembler
from serving.adapter_slots import peft_adapter_name
from tests.reliability.conftest import Replica, running_replica, toy_config

METHODS = ["token", "block", "spectr", "none"]
PROMPT = [5, 9, 14, 30, 41]
# 64 tokens: specials, letters, a space and pieces of several characters that overlap.
PIECES = ["<pad>", "<eos>", "<unk>", " ", *"abcdefghijklmnopqrstuvwxyz"] + [
    "ab", "bc", "ca", "abc", "th", "he", "the", "e ", "an", "na", "ana", "ba", "ban", "st",
    "op", "to", "ot", "sto", "pp", " a", " b", "a ", "b ", "aa", "bb", "cc", "ab ", "xyz",
    "yz", "xy", "stop", "top", "s t", "op!",
]  # fmt: skip


def pieces_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer whose 64 tokens decode to the PIECES, joined (prompts are given as ids)."""
    from tokenizers import Tokenizer, decoders, models

    assert len(PIECES) == 64
    tokenizer = Tokenizer(models.WordLevel({p: i for i, p in enumerate(PIECES)}, "<unk>"))
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def pieces() -> PreTrainedTokenizerFast:
    return pieces_tokenizer()


@pytest.fixture(scope="module")
def engine(target_model, lora_draft, pieces) -> SpeculativeDecoder:
    return SpeculativeDecoder(target_model, lora_draft, pieces)


def decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def expected_answer(tokenizer: Any, ids: list[int], stops: list[str]) -> tuple[int, str]:
    """(tokens, text) of the answer: the shortest prefix whose text holds a stop string, cut
    before the earliest one in it; one token at a time, generation ends there."""
    for end in range(1, len(ids) + 1):
        text = decode(tokenizer, ids[:end])
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return end, text[: min(found)]
    raise AssertionError(f"no stop string of {stops} in {decode(tokenizer, ids)!r}")


def a_stop_in(text: str, seed: int) -> str:
    """A 2- or 3-character piece of ``text`` from its middle, varied by ``seed``."""
    start = len(text) // 3 + seed % 7
    return text[start : start + 2 + seed % 2]


def dropped_past_stop(result: GenerationResult) -> bool:
    """Whether the last step verified tokens after the answer's last token (the case fixed)."""
    assert result.log is not None
    emitted = int((result.log.num_accepted + 1).sum())
    return emitted > len(result.token_ids)


def check_answer(tokenizer: Any, result: GenerationResult, reference: list[int], stops: list[str]):
    num_tokens, text = expected_answer(tokenizer, reference, stops)
    assert result.token_ids == reference[:num_tokens], (stops, decode(tokenizer, reference))
    assert result.text == text and result.finish_reason == "stop"
    assert result.stats.num_generated == num_tokens
    log = result.log
    assert log is not None  # the record holds the answer's tokens, aligned with its targets
    assert log.token_ids[log.prompt_len :].tolist() == result.token_ids
    assert log.target_top_ids.shape[0] == num_tokens == log.target_top_probs.shape[0]
    assert (
        Record.from_generation(log, request_id="r").num_generated == num_tokens
    )  # the record validates


@pytest.mark.parametrize("method", METHODS)
def test_answer_ends_at_the_token_that_completed_the_stop_string(engine, pieces, method):
    dropped = 0
    for seed in range(25):
        options: dict[str, Any] = dict(
            max_tokens=40, seed=seed, method=method, num_spec_tokens=4, stop_token_ids=[]
        )
        reference = engine.generate(PROMPT, **options).token_ids
        stop = a_stop_in(decode(pieces, reference), seed)
        result = engine.generate(PROMPT, stop=[stop], **options)
        check_answer(pieces, result, reference, [stop])
        streamed = list(engine.stream(PROMPT, stop=stop, **options))
        assert [t for chunk in streamed for t in chunk.token_ids] == result.token_ids
        assert "".join(chunk.text for chunk in streamed) == result.text
        dropped += dropped_past_stop(result)
    if method != "none":  # the fix was exercised: steps verified tokens past the stop
        assert dropped > 0


@pytest.mark.parametrize("method", METHODS)
def test_several_stop_strings_end_at_the_first_completed(engine, pieces, method):
    for seed in range(10):
        options: dict[str, Any] = dict(
            max_tokens=40, seed=seed, method=method, num_spec_tokens=4, stop_token_ids=[]
        )
        reference = engine.generate(PROMPT, **options).token_ids
        text = decode(pieces, reference)
        # A long stop that begins before a short one inside it: one token at a time, the short
        # one completes first, so the text ends before the short one, not the long one.
        middle = len(text) // 2
        stops = [text[middle - 3 : middle + 3], text[middle : middle + 2]]
        result = engine.generate(PROMPT, stop=stops, **options)
        check_answer(pieces, result, reference, stops)


def test_greedy_answer_and_its_tokens_do_not_depend_on_the_method(engine, pieces):
    for prompt in (PROMPT, [3, 4], [60, 2, 33, 33]):
        greedy: dict[str, Any] = dict(max_tokens=40, temperature=0, stop_token_ids=[])
        reference = engine.generate(prompt, method="none", **greedy).token_ids
        stop = a_stop_in(decode(pieces, reference), len(prompt))
        answers = {
            method: engine.generate(prompt, method=method, num_spec_tokens=5, stop=stop, **greedy)
            for method in METHODS
        }
        for result in answers.values():
            check_answer(pieces, result, reference, [stop])


def chunked(ids: list[int], rng: random.Random) -> Iterator[list[int]]:
    while ids:
        size = rng.randint(1, 6)
        yield ids[:size]
        ids = ids[size:]


def test_assembler_gives_the_same_text_and_tokens_for_any_step_sizes(pieces):
    """Adding a step's tokens at once equals adding them one at a time."""
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(1, 64) for _ in range(rng.randint(2, 30))]  # <eos> among them
        text = decode(pieces, ids)
        starts = rng.sample(range(len(text)), min(2, len(text)))
        stops = [text[i : i + rng.randint(1, 4)] for i in starts] or ["never"]
        stops += ["never"] if rng.random() < 0.5 else []
        outcomes = []
        for steps in ([[t] for t in ids], list(chunked(ids, rng)), [ids]):
            assembler = TextAssembler(pieces, stops)
            out, kept = "", 0
            for step in steps:
                delta, num_kept = assembler.add(step)
                out, kept = out + delta, kept + num_kept
                if assembler.stopped:
                    break
            outcomes.append((out + assembler.flush(), kept, assembler.stopped))
        assert outcomes[0] == outcomes[1] == outcomes[2], (ids, stops)
        if outcomes[0][2]:
            assert outcomes[0][:2] == expected_answer(pieces, ids, stops)[::-1]


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with running_replica(toy_config("serve.max_tokens_limit=40")) as replica:
        yield replica


@pytest.mark.parametrize("method", METHODS)
def test_http_usage_counts_the_answers_tokens(replica, method):
    runtime, tokenizer = replica.runtime, replica.runtime.tokenizer
    body: dict[str, Any] = {"model": "osd", "prompt": "the cat", "max_tokens": 40}
    body |= {"spec": {"method": method, "k": 4}, "draft": "general"}
    checked = 0
    for seed in range(6):
        free = replica.client.post("/v1/completions", json=body | {"seed": seed}).json()
        osd = free["osd"]
        reference = runtime.engine.generate(
            "the cat",
            max_tokens=40,
            seed=seed,
            method=method,
            num_spec_tokens=4,
            adapter=peft_adapter_name(osd["adapter"], osd["adapter_version"]),
        )
        assert reference.text == free["choices"][0]["text"]  # the same generation
        if reference.finish_reason != "length":
            continue  # ended at the end-of-sequence token; no room for a stop string
        stop = a_stop_in(reference.text, seed)
        num_tokens, text = expected_answer(tokenizer, reference.token_ids, [stop])
        stopped = body | {"seed": seed, "stop": stop}
        answer = replica.client.post("/v1/completions", json=stopped).json()
        assert answer["choices"][0]["text"] == text
        assert answer["usage"]["completion_tokens"] == num_tokens
        streamed = stopped | {"stream": True, "stream_options": {"include_usage": True}}
        events = replica.client.post("/v1/completions", json=streamed).text.split("\n\n")
        usage = [e for e in events if '"usage": {' in e]  # before the last: "usage": null
        assert len(usage) == 1 and f'"completion_tokens": {num_tokens},' in usage[0]
        checked += 1
    assert checked >= 3
