"""A refused request argument says which one as data (``ParamError.param``), not only in text."""

from __future__ import annotations

import pickle

import pytest

from osd import SpeculativeDecoder
from osd.decode.sampling import SamplingParams
from osd.errors import ParamError


@pytest.fixture(scope="module")
def engine(target_model, lora_draft, tokenizer):
    return SpeculativeDecoder(target_model, lora_draft, tokenizer)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [64]}, "prompt"),
        ({"prompt": [1] * 600}, "prompt"),
        ({"method": "beam"}, "method"),
        ({"num_spec_tokens": 0}, "num_spec_tokens"),
        ({"num_drafts": 65}, "num_drafts"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": {64: 1.0}}, "logit_bias"),
        # Several bad arguments: the first checked is named, the prompt before the rest.
        ({"prompt": [], "method": "beam"}, "prompt"),
        ({"method": "beam", "top_p": 0.0}, "method"),
    ],
)
def test_prepare_names_the_refused_argument(engine, kwargs, param):
    prompt = kwargs.pop("prompt", [3, 5, 7])
    with pytest.raises(ParamError) as refused:
        engine.prepare(prompt, **kwargs)
    assert refused.value.param == param
    assert param in str(refused.value)  # the message names it too, for a reader


def test_an_argument_that_is_no_request_parameter_is_a_plain_value_error(engine):
    with pytest.raises(ValueError, match="unknown adapter") as refused:
        engine.prepare([3, 5], adapter="nope")
    assert not isinstance(refused.value, ParamError)


def test_param_error_survives_pickling_with_its_param():
    with pytest.raises(ParamError) as refused:
        SamplingParams(top_k=-1)
    copy = pickle.loads(pickle.dumps(refused.value))
    assert (type(copy), copy.param, str(copy)) == (ParamError, "top_k", str(refused.value))
