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


def test_a_named_budget_beyond_the_context_is_refused_a_fitting_one_is_cut(engine):
    with pytest.raises(ParamError) as refused:
        engine.prepare([3] * 500, max_tokens=100, fit_context=False)
    assert refused.value.param == "max_tokens" and "context" in str(refused.value)
    cut = engine.prepare([3] * 500, max_tokens=100)  # fit_context: the Python API's default
    assert cut.max_new_tokens == engine.max_context - 500


class _BosTokenizer:
    """Adds its BOS to every text, as Llama's and Gemma's tokenizers do."""

    bos_token, bos_token_id = "<s>", 1

    def __call__(self, text: str) -> dict[str, list[int]]:
        words = text.replace("<s>", " <s> ").split()
        return {"input_ids": [1] + [1 if w == "<s>" else 2 + len(w) for w in words]}


def test_a_text_that_writes_its_own_bos_does_not_get_a_second():
    from osd.decode.request_checks import prompt_ids

    # A chat template that starts with {{ bos_token }}: one BOS, as the model was trained.
    assert prompt_ids("<s>user: hi", _BosTokenizer(), 64) == [1, 7, 4]
    assert prompt_ids("user: hi", _BosTokenizer(), 64) == [1, 7, 4]
