"""One request's options (issue 27, item 1): one frozen value built once at the edge (the HTTP
request or the Python API's keywords), carried unchanged into the engine's request, its log
and its record."""

from __future__ import annotations

import dataclasses

import pytest

from osd import SpeculativeDecoder
from osd.buffer.record import Record
from osd.config import SpecConfig
from osd.decode.options import OPTION_NAMES, SAMPLING_NAMES, RequestOptions
from osd.errors import ParamError
from serving.protocol import _SAME_AS_OPTIONS, ChatRequest, CompletionRequest


@pytest.fixture(scope="module")
def decoder(target_model, lora_draft, tokenizer):
    return SpeculativeDecoder(target_model, lora_draft, tokenizer)


def test_keywords_take_the_python_apis_looser_spellings_and_refuse_unknown_names():
    options = RequestOptions.of(logit_bias={5: 1.5}, stop="\n", stop_token_ids=[7], top_k=3)
    assert options.sampling.logit_bias == ((5, 1.5),) and options.stop == ("\n",)
    assert options.stop_token_ids == (7,) and options.sampling.top_k == 3
    half = RequestOptions.of(options, top_p=0.5)
    assert half.sampling == dataclasses.replace(options.sampling, top_p=0.5)
    assert dataclasses.replace(half, sampling=options.sampling) == options
    assert RequestOptions.of(options) is options
    with pytest.raises(ParamError, match="'max_token' is not a request option"):
        RequestOptions.of(max_token=3)
    with pytest.raises(ParamError, match="top_p must be in"):
        RequestOptions.of(top_p=0)


def test_the_engine_carries_the_value_unchanged_to_the_record(decoder):
    options = RequestOptions.of(max_tokens=6, temperature=0.7, top_p=0.9, seed=11, method="token")
    request = decoder.prepare([3, 5, 7], options)
    assert request.options is options
    assert (request.method, request.seed, request.params) == ("token", 11, options.sampling)
    assert (
        decoder.prepare(
            [3, 5, 7], max_tokens=6, temperature=0.7, top_p=0.9, seed=11, method="token"
        ).options
        == options
    )
    result = decoder.generate([3, 5, 7], options)
    assert result.log is not None and result.log.request.options is options
    record = Record.from_generation(result.log, request_id="r")
    assert (record.temperature, record.top_p, record.seed) == pytest.approx((0.7, 0.9, 11))


def test_an_http_request_builds_the_value_once_with_fields_taken_by_name():
    assert {"temperature", "top_p", "top_k", "min_p", "seed"} <= set(_SAME_AS_OPTIONS)
    assert set(_SAME_AS_OPTIONS) <= OPTION_NAMES
    request = ChatRequest(
        model="osd",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=9,
        temperature=0.5,
        top_p=0.8,
        top_k=4,
        min_p=0.1,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        logit_bias={"5": 2.0},
        stop="x",
        seed=3,
        logprobs=True,
        top_logprobs=2,
        domain="sql",
        spec={"method": "spectr", "k": 3, "K": 2, "proposer": "draft"},
    )
    options = request.options(SpecConfig(), 1024)
    for name in _SAME_AS_OPTIONS:
        held = options.sampling if name in SAMPLING_NAMES else options
        assert getattr(held, name) == getattr(request, name), name
    assert options == RequestOptions.of(
        max_tokens=9,
        temperature=0.5,
        top_p=0.8,
        top_k=4,
        min_p=0.1,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        logit_bias={5: 2.0},
        stop=("x",),
        seed=3,
        method="spectr",
        num_spec_tokens=3,
        num_drafts=2,
        route="sql",
        logprobs=2,
        proposer="draft",
        fit_context=False,  # the client named its budget: refused where it does not fit
    )
    defaults = SpecConfig(method="token", num_spec_tokens=5, proposer="suffix")
    plain = CompletionRequest(model="osd", prompt="hi", echo=True, logprobs=1)
    assert plain.options(defaults, 1024) == RequestOptions.of(
        max_tokens=16,  # OpenAI's completions default, cut to what fits
        method="token",
        num_spec_tokens=5,
        proposer="suffix",
        logprobs=1,
        prompt_logprobs=1,
    )
