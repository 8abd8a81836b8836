"""serving.protocol, called directly: request bodies validate into the request models or are
refused with an APIError (400) naming the field, and errors serialise to OpenAI's envelope.

Which OpenAI fields are implemented, harmless or refused, over HTTP, is
``test_openai_fields.py``; the HTTP layer's answers to bad bodies are in
``tests/reliability/test_bad_requests.py``. No server here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from serving.protocol import (
    APIError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    error_body,
    parse_request,
)

COMPLETION = {"model": "osd", "prompt": "the cat"}
CHAT = {"model": "osd", "messages": [{"role": "user", "content": "hi"}]}


def completion(**fields: Any) -> CompletionRequest:
    request = parse_request("completion", {**COMPLETION, **fields})
    assert isinstance(request, CompletionRequest)
    return request


def chat(**fields: Any) -> ChatRequest:
    request = parse_request("chat", {**CHAT, **fields})
    assert isinstance(request, ChatRequest)
    return request


def refusal(kind: str, body: Any) -> APIError:
    with pytest.raises(APIError) as refused:
        parse_request(kind, body)  # type: ignore[arg-type]
    assert refused.value.status == 400
    return refused.value


def test_a_minimal_request_gets_the_documented_defaults():
    request = completion()
    assert (request.temperature, request.top_p, request.top_k, request.n) == (1.0, 1.0, 0, 1)
    assert request.log is True and request.stream is False
    assert request.stop_list == [] and request.token_bias == {}
    assert request.num_logprobs is None and request.num_prompt_logprobs is None
    assert not request.include_usage


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 2**31}, "top_k"),  # the record stores it as int32
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),  # no completion asked for, and no echo
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 17}, "n"),
        ({"n": 2.0}, "n"),  # strict: a float is no count
        ({"logprobs": 21}, "logprobs"),  # vLLM's bound (OpenAI's is 5)
        ({"top_logprobs": 2}, "top_logprobs"),  # chat's field
        ({"echo": "yes"}, "echo"),
        ({"seed": 2**63}, "seed"),  # int64 in the record
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 65}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"logit_bias": {"cat": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {str(i): 0.0 for i in range(1025)}}, "logit_bias"),
        ({"domain": "a\nb"}, "domain"),  # a record label: printable
        ({"domain": "é" * 65}, "domain"),  # and at most 128 bytes
        ({"draft": "d" * 129}, "draft"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["one", ""]}, "prompt"),  # a list of prompts, one of them empty
        ({"prompt": ["one", [1, 2]]}, "prompt"),  # texts and ids mixed
        ({"prompt": "\ud800"}, "prompt"),  # a lone surrogate no tokenizer can encode
        ({"spec": {"method": "beam"}}, "spec.method"),
        ({"spec": {"k": 17}}, "spec.k"),  # the union's arm is not part of the name
        ({"spec": {"K": 9}}, "spec.K"),
        ({"spec": {"depth": 2}}, "spec.depth"),  # osd's own options forbid unknown keys
        (  # OpenAI's names: letters, digits, underscores and dashes
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
            "response_format.json_schema.name",
        ),
        (  # vLLM's switch, true being what osd's JSON always is
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
            "structured_outputs.disable_any_whitespace",
        ),
    ],
)
def test_a_bad_completion_field_is_refused_by_its_path(fields, param):
    error = refusal("completion", {**COMPLETION, **fields})
    assert error.param == param
    assert error.message.startswith(param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),  # strict: chat's is a bool
        ({"echo": True}, "echo"),  # a completions field
    ],
)
def test_a_bad_chat_field_is_refused_by_its_path(fields, param):
    error = refusal("chat", {**CHAT, **fields})
    assert error.param == param


def test_vllms_compact_json_switch_is_taken():
    body = {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}
    assert parse_request("completion", {**COMPLETION, **body}).structured_outputs is not None


def test_a_chat_without_messages_is_told_they_are_required():
    error = refusal("chat", {"model": "osd"})
    assert error.param == "messages" and "Field required" in str(error)


@pytest.mark.parametrize(
    ("field", "code"),
    [
        ({"max_token": 5}, "unknown_parameter"),  # a typo is not silently ignored
        ({"best_of": 3}, "unsupported_parameter"),  # asks for what osd does not do
    ],
)
def test_a_field_osd_does_not_implement_is_refused_with_a_code(field, code):
    error = refusal("completion", {**COMPLETION, **field})
    assert error.param == next(iter(field)) and error.code == code


@pytest.mark.parametrize("body", [[COMPLETION], "the cat", None, 3])
def test_a_body_that_is_no_json_object_is_refused(body):
    assert "JSON object" in refusal("completion", body).message


def test_tiny_temperatures_are_recorded_as_greedy():
    assert completion(temperature=1e-7).temperature == 0.0
    assert completion(temperature=0.01).temperature == 0.01


def test_fields_reach_the_engine_in_its_shapes():
    request = completion(
        logit_bias={"7": -5, "12": 1.5},
        stop="END",
        prompt=["a one-prompt list"],
        stream=True,
        stream_options={"include_usage": True},
    )
    assert request.token_bias == {7: -5.0, 12: 1.5}
    assert request.stop_list == ["END"]
    assert request.prompt == "a one-prompt list"
    assert request.include_usage
    assert completion(prompt=[3, 5, 7]).prompt == [3, 5, 7]  # token ids stay ids


@pytest.mark.parametrize(
    ("fields", "num_logprobs", "num_prompt_logprobs"),
    [
        ({"logprobs": 2}, 2, None),
        ({"logprobs": 0}, 0, None),  # the sampled token's own logprob, no alternatives
        ({"logprobs": False}, None, None),  # the no-op some clients send
        ({"logprobs": 3, "echo": True}, 3, 3),
        ({"echo": True, "max_tokens": 0}, None, None),  # the prompt alone, echoed
    ],
)
def test_completion_logprobs(fields, num_logprobs, num_prompt_logprobs):
    request = completion(**fields)
    assert request.num_logprobs == num_logprobs
    assert request.num_prompt_logprobs == num_prompt_logprobs


@pytest.mark.parametrize(
    ("fields", "num_logprobs"),
    [({}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 4}, 4)],
)
def test_chat_logprobs(fields, num_logprobs):
    assert chat(**fields).num_logprobs == num_logprobs


def test_vllms_top_k_of_minus_one_keeps_every_token():
    assert completion(top_k=-1).top_k == 0
    assert refusal("completion", {"model": "osd", "prompt": "a", "top_k": -2}).param == "top_k"


def test_openai_nulls_mean_the_defaults():
    request = completion(temperature=None, stop=None, seed=None, max_tokens=None)
    assert request.temperature == 1.0 and request.stop_list == [] and request.seed is None


def test_a_chat_message_serialises_its_name_only_when_sent():
    request = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi", "name": "ada"},
        ]
    )
    assert [m.model_dump() for m in request.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "ada"},
    ]
    assert ChatMessage(role="user", content="x").model_dump_json() == (
        '{"role":"user","content":"x"}'
    )


def test_errors_serialise_to_openais_envelope():
    error = APIError(429, "busy", code="overloaded", kind="rate_limit_error")
    assert error.body()["error"] == {
        "message": "busy",
        "type": "rate_limit_error",
        "param": None,
        "code": "overloaded",
    }
    assert json.loads(json.dumps(error_body("bad", param="top_p"))) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": None}
    }
    assert str(error) == "busy"


def test_a_completion_lists_its_prompts_one_or_several():
    assert completion(prompt="the cat").prompts == ["the cat"]  # a text is one prompt
    assert completion(prompt=[3, 5, 7]).prompts == [[3, 5, 7]]  # so is a list of ids
    assert completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert completion(prompt=[[1, 2], [3]]).prompts == [[1, 2], [3]]
    assert [r.prompt for r in completion(prompt=["a", "b"]).each_prompt()] == ["a", "b"]
