"""What a client moving from vLLM's OpenAI server expects besides completions: ``/tokenize``,
``/detokenize``, ``/version``, ``/v1/models``' ``max_model_len``, CORS for browser pages, a
405's ``Allow``, vLLM's ``stream_options`` defaults, and a batch of prompts larger than the
replica takes refused with a 400 (never a 429 that no retry can pass). Requests go through a
Ray-free replica's app."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.reliability.conftest import Replica, running_replica, toy_config

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with running_replica(toy_config("serve.max_ongoing_requests=4")) as replica:
        yield replica


def test_tokenize_counts_a_prompt_as_completions_read_it(replica):
    tokenized = replica.client.post("/tokenize", json={"model": "osd", "prompt": "the cat"})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    assert body["max_model_len"] == replica.runtime.batch.max_len
    answer = replica.complete(prompt="the cat", max_tokens=1).json()
    assert answer["usage"]["prompt_tokens"] == body["count"]
    ids = replica.client.post("/tokenize", json={"prompt": body["tokens"]}).json()
    assert ids["tokens"] == body["tokens"]  # ids are taken as they are; model optional
    back = replica.client.post("/detokenize", json={"model": "osd", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "the cat"}


def test_tokenize_renders_a_chat_as_chat_completions_do(replica):
    body = {"messages": CHAT, "return_token_strs": True, "add_generation_prompt": True}
    tokenized = replica.client.post("/tokenize", json=body).json()
    assert len(tokenized["token_strs"]) == tokenized["count"]
    answer = replica.client.post(
        "/v1/chat/completions", json={"model": "osd", "messages": CHAT, "max_tokens": 1}
    ).json()
    assert answer["usage"]["prompt_tokens"] == tokenized["count"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "max_tokens": 3}, 400, "max_tokens"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, 400, "return_token_strs"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": False}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, 400, "messages[0].role"),
        (
            "/tokenize",
            {"messages": CHAT, "add_generation_prompt": False},
            400,
            "add_generation_prompt",
        ),
        (  # an earlier call's arguments with an integer longer than Python reads
            "/tokenize",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"function": {"name": "f", "arguments": '{"x": ' + "1" * 5000 + "}"}}
                        ],
                    }
                ]
            },
            400,
            "messages[0].tool_calls[0].function.arguments",
        ),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"prompt": "a"}, 400, "prompt"),
    ],
)
def test_bad_tokenize_requests_are_refused_by_name(replica, path, body, status, param):
    refused = replica.client.post(path, json=body)
    assert refused.status_code == status, refused.text
    assert refused.json()["error"]["param"] == param


def test_version_and_models_say_what_vllm_clients_read(replica):
    assert replica.client.get("/version").json()["version"]
    model = replica.client.get("/v1/models").json()["data"][0]
    assert model["id"] == "osd" and model["max_model_len"] == replica.runtime.batch.max_len
    assert model["root"] == replica.runtime.config.model.target


def test_browser_pages_may_call_the_api_where_their_origin_is_allowed():
    config = toy_config("serve.cors_allowed_origins=['*']", "serve.api_keys=[k1]")
    with running_replica(config) as replica:
        _assert_cors(replica)


def _assert_cors(replica: Replica) -> None:
    # The preflight carries no key (browsers send none): it is answered all the same.
    preflight = replica.client.options(
        "/v1/chat/completions",
        headers={
            "Origin": "http://page.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    body = {"model": "osd", "prompt": "a", "max_tokens": 1}
    keyed = {"Authorization": "Bearer k1"}
    answer = replica.client.post("/v1/completions", json=body, headers=keyed)
    assert "access-control-allow-origin" not in answer.headers  # no Origin: no CORS headers
    cross = replica.client.post(
        "/v1/completions", json=body, headers={**keyed, "Origin": "http://page.example"}
    )
    assert cross.status_code == 200 and cross.headers["access-control-allow-origin"] == "*"
    # Without the key the page is refused, and can read that it was.
    refused = replica.client.post(
        "/v1/completions", json=body, headers={"Origin": "http://page.example"}
    )
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    # A fault inside the replica: Starlette answers it outside the CORS middleware.
    runtime = replica.runtime

    def broken(model: str) -> None:
        raise RuntimeError("a fault")

    runtime.check_model = broken  # type: ignore[method-assign]
    try:
        failed = replica.client.post(
            "/v1/completions", json=body, headers={**keyed, "Origin": "http://page.example"}
        )
    finally:
        del runtime.check_model
    assert failed.status_code == 500 and failed.headers["access-control-allow-origin"] == "*"
    assert "a fault" in failed.json()["error"]["message"]


def test_no_cors_headers_by_default(replica):
    # A web page the operator visits must not use a keyless local server.
    cross = replica.client.post(
        "/v1/completions",
        json={"model": "osd", "prompt": "a", "max_tokens": 1},
        headers={"Origin": "http://page.example"},
    )
    assert cross.status_code == 200
    assert "access-control-allow-origin" not in cross.headers


def test_a_wrong_method_says_which_are_allowed(replica):
    wrong = replica.client.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"]


def test_more_prompts_than_the_replica_takes_are_a_400_not_a_429(replica):
    # serve.max_ongoing_requests=4: every prompt of a request takes a place at once, so five
    # could never be admitted and a 429 would be retried for ever.
    body = {"model": "osd", "prompt": ["a"] * 5, "max_tokens": 1}
    refused = replica.client.post("/v1/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    answered = replica.client.post("/v1/completions", json={**body, "prompt": ["a"] * 4})
    assert answered.status_code == 200 and len(answered.json()["choices"]) == 4


def _usage_events(replica: Replica, options: object) -> list[dict]:
    body = {"model": "osd", "prompt": "a", "max_tokens": 2, "stream": True}
    response = replica.client.post("/v1/completions", json={**body, "stream_options": options})
    assert response.status_code == 200, response.text
    events = [e[6:] for e in response.text.split("\n\n") if e.startswith("data: {")]
    return [json.loads(e) for e in events if json.loads(e).get("usage")]


def test_stream_options_follow_vllm(replica):
    # Sent without include_usage, vLLM's default is on; null and false are off.
    assert len(_usage_events(replica, {})) == 1
    assert len(_usage_events(replica, {"include_usage": True})) == 1
    assert _usage_events(replica, {"include_usage": None}) == []
    assert _usage_events(replica, {"include_usage": False}) == []
    assert len(_usage_events(replica, {"include_usage": True, "include_obfuscation": False})) == 1
    # vLLM's continuous usage comes only with the usage asked for.
    continuous = {"include_usage": False, "continuous_usage_stats": True}
    assert _usage_events(replica, continuous) == []
    assert len(_usage_events(replica, {"continuous_usage_stats": True})) > 1
    misspelt = replica.client.post(
        "/v1/completions",
        json={
            "model": "osd",
            "prompt": "a",
            "stream": True,
            "stream_options": {"include_usages": True},
        },
    )
    assert misspelt.status_code == 400 and "include_usages" in misspelt.json()["error"]["param"]


def test_a_stream_that_asked_for_usage_says_null_until_its_end_as_openai(replica):
    def events(options: object) -> list[dict]:
        body = {"model": "osd", "prompt": "a", "max_tokens": 3, "stream": True, "ignore_eos": True}
        response = replica.client.post("/v1/completions", json={**body, **options})
        assert response.status_code == 200, response.text
        return [json.loads(e[6:]) for e in response.text.split("\n\n") if e.startswith("data: {")]

    asked = events({"stream_options": {"include_usage": True}})
    assert [e["usage"] for e in asked[:-1]] == [None] * (len(asked) - 1)
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 3
    assert all("usage" not in e for e in events({}))


def test_a_chat_answer_says_nothing_was_refused(replica):
    body = {"model": "osd", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = replica.client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["refusal"] is None


def test_an_empty_list_of_earlier_calls_needs_no_chat_template(replica):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "tool_calls": []},
        {"role": "user", "content": "and?"},
    ]
    answer = replica.client.post(
        "/v1/chat/completions", json={"model": "osd", "messages": messages, "max_tokens": 1}
    )
    assert answer.status_code == 200, answer.text
