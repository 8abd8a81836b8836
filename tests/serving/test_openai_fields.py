"""Every field of OpenAI's completions and chat requests is implemented, harmlessly ignored or
refused with a 400 naming it; never silently ignored when it asks for something (issue 14).

The fields come from the installed ``openai`` package's request types, so a field a new version
adds fails ``test_every_openai_field_has_a_row`` until it is classified in
``serving.openai_fields`` and given a row here. Requests go through a Ray-free replica's app.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types import CompletionCreateParams as CompletionParams
from openai.types.chat import ChatCompletionContentPartParam, ChatCompletionMessageParam
from openai.types.chat import ChatCompletionContentPartRefusalParam as ContentPartRefusal
from openai.types.chat import CompletionCreateParams as ChatParams

from serving.openai_fields import (
    HARMLESS,
    IMPLEMENTED,
    MESSAGE_HARMLESS,
    MESSAGE_IMPLEMENTED,
    MESSAGE_REFUSED,
    PART_REFUSED,
    REFUSED,
)
from serving.protocol import APIError, parse_request
from tests.reliability.conftest import Replica, running_replica, toy_config
from tests.serving.test_tools_api import TEMPLATE

PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
BASE = {
    "completion": {"model": "osd", "prompt": "the cat", "max_tokens": 2},
    "chat": {"model": "osd", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
REQUIRED = ("model", "prompt", "messages")  # in every request already


def openai_fields(params: Any) -> set[str]:
    """The top-level fields of an openai request type (a union of streaming/non-streaming)."""
    return {name for t in typing.get_args(params) for name in typing.get_type_hints(t)}


FIELDS = {"completion": openai_fields(CompletionParams), "chat": openai_fields(ChatParams)}

ACCEPTED, REFUSE = "accepted", "refused"
# field -> (a value that is not the default, what osd answers)
NON_DEFAULT: dict[str, tuple[Any, str]] = {
    "max_tokens": (3, ACCEPTED),
    "max_completion_tokens": (3, ACCEPTED),
    "temperature": (0.5, ACCEPTED),
    "top_p": (0.9, ACCEPTED),
    "seed": (7, ACCEPTED),
    "stop": (["\n", "zz"], ACCEPTED),
    "stream": (True, ACCEPTED),
    "stream_options": ({"include_usage": True}, ACCEPTED),
    "presence_penalty": (0.5, ACCEPTED),
    "frequency_penalty": (0.5, ACCEPTED),
    "logit_bias": ({"1": 5}, ACCEPTED),
    "user": ("alice", ACCEPTED),
    "safety_identifier": ("alice-hash", ACCEPTED),
    "metadata": ({"team": "search"}, ACCEPTED),
    "prompt_cache_key": ("my-app", ACCEPTED),
    "prompt_cache_retention": ("24h", ACCEPTED),
    "prompt_cache_options": ({"mode": "explicit", "ttl": "30m"}, ACCEPTED),
    "parallel_tool_calls": (False, ACCEPTED),
    "n": (2, ACCEPTED),  # 1..16 choices (tests/serving/test_choices_api.py)
    "logprobs": (2, ACCEPTED),  # chat: true (CHAT_VALUES)
    "top_logprobs": (2, ACCEPTED),  # chat only, beside logprobs: true (WITH)
    "echo": (True, ACCEPTED),  # completions only
    "best_of": (2, REFUSE),
    "suffix": (" the end", REFUSE),
    "response_format": ({"type": "json_object"}, ACCEPTED),  # test_structured_output_api.py
    "store": (True, REFUSE),
    "service_tier": ("priority", REFUSE),
    "tools": ([{"type": "function", "function": {"name": "f"}}], ACCEPTED),  # test_tools_api.py
    "tool_choice": ("required", ACCEPTED),
    "functions": ([{"name": "f"}], REFUSE),
    "function_call": ({"name": "f"}, REFUSE),
    "audio": ({"voice": "alloy", "format": "wav"}, REFUSE),
    "modalities": (["text", "audio"], REFUSE),
    "prediction": ({"type": "content", "content": "the cat sat"}, REFUSE),
    "web_search_options": ({"search_context_size": "low"}, REFUSE),
    # Given to a chat template that takes it (gpt-oss's); the toy model's has none: a 400.
    "reasoning_effort": ("high", "template"),
    "verbosity": ("low", REFUSE),
    "moderation": ({"model": "omni-moderation-latest"}, REFUSE),
}
CHAT_VALUES = {"logprobs": True}
# fields a non-default value needs beside it
WITH = {
    "top_logprobs": {"logprobs": True},
    "tool_choice": {"tools": NON_DEFAULT["tools"][0]},
    "stream_options": {"stream": True},  # alone it is a 400, as vLLM answers
}

# field -> its no-op values, which clients (LangChain and others) send on every request
DEFAULTS: dict[str, list[Any]] = {
    "n": [1, None],
    "logprobs": [False, None],
    "top_logprobs": [0, None],
    "echo": [False, None],
    "best_of": [1, None],
    "suffix": [None, ""],
    "response_format": [{"type": "text"}, None],
    "store": [False, None],
    "service_tier": ["auto", "default", None],
    "tools": [[], None],
    "tool_choice": ["none", "auto", None],
    "functions": [[], None],
    "function_call": ["none", "auto", None],
    "audio": [None],
    "modalities": [["text"], None],
    "prediction": [None],
    "web_search_options": [None],
    "reasoning_effort": ["none", None],
    "verbosity": ["medium", None],
    "moderation": [None],
    "stream_options": [None],
    "temperature": [None],
    "top_p": [None],
    "stream": [None, False],
    "seed": [None],
    "stop": [None],
    "presence_penalty": [None],
    "frequency_penalty": [None],
    "logit_bias": [None],
}


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    # With a chat template that shows tools: tool calling is served (tests/serving/test_tools_api).
    with running_replica(toy_config(f"model.chat_template={json.dumps(TEMPLATE)}")) as replica:
        yield replica


def post(replica: Replica, kind: str, **fields: Any) -> Any:
    return replica.client.post(PATHS[kind], json={**BASE[kind], **fields})


def assert_refused(response: Any, field: str, code: str = "unsupported_parameter") -> None:
    assert response.status_code == 400, (field, response.text)
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (field, code), error
    assert error["message"].startswith(field), error
    assert error["type"] == "invalid_request_error"


def assert_answered(response: Any, field: str) -> None:
    assert response.status_code == 200, (field, response.text)
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
    else:
        assert response.json()["choices"]


def non_default_cases() -> list[Any]:
    return [
        pytest.param(kind, field, id=f"{kind}-{field}")
        for kind, fields in FIELDS.items()
        for field in sorted(fields)
        if field not in REQUIRED
    ]


@pytest.mark.parametrize("kind", sorted(FIELDS))
def test_every_openai_field_has_a_row(kind):
    classified = IMPLEMENTED | set(HARMLESS) | set(REFUSED)
    assert not FIELDS[kind] - classified, "classify these in serving/openai_fields.py"
    assert not FIELDS[kind] - set(NON_DEFAULT) - set(REQUIRED), "give these a row here"
    refused = {f for f, (_, outcome) in NON_DEFAULT.items() if outcome == REFUSE}
    assert refused & FIELDS[kind] == set(REFUSED) & FIELDS[kind]


@pytest.mark.parametrize(("kind", "field"), non_default_cases())
def test_a_field_that_asks_for_something_is_used_or_refused_by_name(replica, kind, field):
    value, outcome = NON_DEFAULT[field]
    value = CHAT_VALUES.get(field, value) if kind == "chat" else value
    response = post(replica, kind, **{field: value}, **WITH.get(field, {}))
    if outcome in (REFUSE, "template"):
        assert_refused(response, field)
    else:
        assert_answered(response, field)


@pytest.mark.parametrize(
    ("field", "value"),
    [pytest.param(f, v, id=f"{f}={v!r}") for f, values in DEFAULTS.items() for v in values],
)
def test_a_default_value_is_accepted(replica, field, value):
    for kind in PATHS:
        if field in FIELDS[kind]:
            assert_answered(post(replica, kind, **{field: value}), field)


def test_what_common_clients_send_by_default_is_answered(replica):
    # Every no-op at once, as a client that fills in its defaults sends them.
    for kind in PATHS:
        defaults = {f: values[0] for f, values in DEFAULTS.items() if f in FIELDS[kind]}
        assert_answered(post(replica, kind, **defaults), kind)


def test_the_deprecated_function_call_is_refused_beside_empty_functions(replica):
    named = post(replica, "chat", functions=[], function_call={"name": "f"})
    assert_refused(named, "function_call")


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_token", 3), ("temprature", 0.5), ("", 1), ("Temperature", 0.5), ("draft_id", "x")],
)
def test_an_unknown_field_is_refused_by_name(replica, field, value):
    for kind in PATHS:
        assert_refused(post(replica, kind, **{field: value}), field, "unknown_parameter")


@pytest.mark.parametrize(
    ("field", "default", "other"),
    [
        ("min_tokens", 0, 2),
        ("include_stop_str_in_output", False, True),
        ("add_generation_prompt", True, False),
        ("use_beam_search", False, True),
        ("priority", 0, 3),
        ("bad_words", [], ["cat"]),
        ("allowed_token_ids", None, [5, 6]),
        ("return_tokens_as_token_ids", False, True),
        ("return_token_ids", None, True),
        ("guided_decoding_backend", None, "outlines"),
        ("logits_processors", None, ["mine"]),
        ("cache_salt", None, "tenant-1"),
        ("kv_transfer_params", None, {"remote": 1}),
        ("vllm_xargs", {}, {"a": 1}),
    ],
)
def test_vllm_extras_are_accepted_at_their_default_and_refused_otherwise(
    replica, field, default, other
):
    for kind in PATHS:
        assert_answered(post(replica, kind, **{field: default}), field)
        assert_refused(post(replica, kind, **{field: other}), field)


def test_add_special_tokens_is_accepted_at_each_endpoints_own_default(replica):
    # vLLM adds special tokens to a completion's prompt and not to a rendered chat.
    for kind, default in (("completion", True), ("chat", False)):
        assert_answered(post(replica, kind, add_special_tokens=default), kind)
        assert_answered(post(replica, kind, add_special_tokens=None), kind)
        assert_refused(post(replica, kind, add_special_tokens=not default), "add_special_tokens")


@pytest.mark.parametrize(
    ("field", "value"),
    [("user", 123), ("user", ["a"]), ("metadata", "x"), ("metadata", {"a": 1})],
)
def test_an_ignored_field_of_the_wrong_type_is_refused(replica, field, value):
    for kind in PATHS:
        assert_refused(post(replica, kind, **{field: value}), field, "invalid_type")
    for kind in PATHS:  # their right types still pass, vLLM's request_id among them
        ok = {"user": "u-1", "metadata": {"a": "b"}, "request_id": "r-1"}
        assert_answered(post(replica, kind, **ok), kind)


def test_osd_own_fields_are_known(replica):
    own = {"top_k": 5, "draft": "code", "domain": "sql", "spec": {"method": "token"}, "log": False}
    for kind in PATHS:
        assert_answered(post(replica, kind, **own), kind)


def test_the_official_client_sees_the_refused_field(replica):
    client = replica.openai()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="osd", prompt="the cat", max_tokens=2, best_of=2)
    assert refused.value.param == "best_of" and refused.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as typo:
        client.chat.completions.create(
            model="osd",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"max_token": 2},
        )
    assert typo.value.param == "max_token" and typo.value.code == "unknown_parameter"
    out = client.chat.completions.create(
        model="osd",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        n=1,
        logprobs=False,
        response_format={"type": "text"},
        metadata={"run": "test"},
    )
    assert out.usage is not None and out.usage.completion_tokens >= 1


def test_stop_token_ids_end_generation_at_the_first_of_them(replica):
    """vLLM's stop_token_ids, besides end-of-sequence: generation stops at the first one
    generated, which is kept (and counted) like an end-of-sequence token, its text left out
    of the answer as vLLM leaves it."""
    prompt, tokens = "the cat", 8  # the toy config allows 8
    alone = replica.runtime.engine.generate(prompt, max_tokens=tokens, temperature=0, method="none")
    ids = alone.token_ids
    cut = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # first new token
    body = {**BASE["completion"], "max_tokens": tokens, "temperature": 0, "prompt": prompt}
    answer = replica.client.post(PATHS["completion"], json={**body, "stop_token_ids": [ids[cut]]})
    assert answer.json()["usage"]["completion_tokens"] == cut + 1
    assert answer.json()["choices"][0]["finish_reason"] == "stop"
    tokenizer = replica.runtime.tokenizer
    assert answer.json()["choices"][0]["text"] == tokenizer.decode(ids[:cut])
    assert_answered(post(replica, "chat", stop_token_ids=[ids[cut]]), "stop_token_ids")
    bad = post(replica, "completion", stop_token_ids=[-1])
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("stop_token_ids")


def test_ignore_eos_generates_past_the_end_of_sequence_token(replica):
    """vLLM's ignore_eos: the end-of-sequence token no longer ends generation (what serving
    benchmarks send to generate exactly max_tokens); stop_token_ids still do."""
    prompt, tokens = "the cat", 8
    alone = replica.runtime.engine.generate(prompt, max_tokens=tokens, temperature=0, method="none")
    ids = alone.token_ids
    cut = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    # The greedy continuation's token at `cut` plays end-of-sequence for this test.
    engine = replica.runtime.engine
    eos = engine.eos_token_ids
    engine.eos_token_ids = (ids[cut],)
    try:
        body = {**BASE["completion"], "max_tokens": tokens, "temperature": 0, "prompt": prompt}
        ended = replica.client.post(PATHS["completion"], json=body).json()
        past = replica.client.post(PATHS["completion"], json={**body, "ignore_eos": True}).json()
    finally:
        engine.eos_token_ids = eos
    assert ended["usage"]["completion_tokens"] == cut + 1
    assert ended["choices"][0]["finish_reason"] == "stop"
    assert past["usage"]["completion_tokens"] == tokens
    assert past["choices"][0]["finish_reason"] == "length"
    chat = post(replica, "chat", ignore_eos=True)
    assert_answered(chat, "ignore_eos")
    bad = post(replica, "completion", ignore_eos="yes")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ignore_eos"


# Inside chat messages: every field of OpenAI's message types, and every content part type.
MESSAGE_FIELDS = openai_fields(ChatCompletionMessageParam)
PART_TYPES = {
    typing.get_args(typing.get_type_hints(t)["type"])[0]
    for t in (*typing.get_args(ChatCompletionContentPartParam), ContentPartRefusal)
}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# field -> (a message with a value that is not the default, what osd answers)
MESSAGE_ROWS: dict[str, tuple[dict[str, Any], str]] = {
    "role": ({"role": "developer", "content": "be brief"}, ACCEPTED),
    "content": ({"role": "user", "content": [{"type": "text", "text": "hi"}]}, ACCEPTED),
    "name": ({"role": "user", "content": "hi", "name": "alice"}, ACCEPTED),
    "tool_calls": ({"role": "assistant", "content": None, "tool_calls": [CALL]}, ACCEPTED),
    "tool_call_id": ({"role": "tool", "content": "42", "tool_call_id": "c1"}, ACCEPTED),
    "function_call": ({"role": "assistant", "function_call": CALL["function"]}, REFUSE),
    "audio": ({"role": "assistant", "content": "hi", "audio": {"id": "a1"}}, REFUSE),
    "refusal": ({"role": "assistant", "content": None, "refusal": "I cannot"}, REFUSE),
}
# A message's no-op values, each accepted.
MESSAGE_DEFAULTS = [
    {"role": "assistant", "content": None, "tool_calls": [], "function_call": None},
    {"role": "assistant", "content": "ok", "audio": None, "refusal": None, "name": None},
    {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "user", "content": "hi", "name": "bob"},
]
PART_ROWS: dict[str, tuple[dict[str, Any], str]] = {
    "text": ({"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}}, ""),
    "image_url": ({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, REFUSE),
    "input_audio": ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, REFUSE),
    "file": ({"type": "file", "file": {"file_id": "f1"}}, REFUSE),
    "refusal": ({"type": "refusal", "refusal": "I cannot"}, REFUSE),
}


def chat_with(message: dict[str, Any]) -> dict[str, Any]:
    """A chat body whose second message is ``message``."""
    first = {"role": "user", "content": "hi"}
    return {**BASE["chat"], "messages": [first, message, {"role": "user", "content": "go on"}]}


def refused_by(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """(param, code) of the 400 a chat body gets from the request parser; (None, None) if none."""
    try:
        parse_request("chat", body)
    except APIError as exc:
        assert exc.status == 400 and exc.message.startswith(exc.param or "")
        return exc.param, exc.code
    return None, None


def test_every_message_field_and_content_part_has_a_row():
    classified = MESSAGE_IMPLEMENTED | set(MESSAGE_HARMLESS) | set(MESSAGE_REFUSED)
    assert classified >= MESSAGE_FIELDS, "classify these in serving/openai_fields.py"
    assert set(MESSAGE_ROWS) == MESSAGE_FIELDS, "give these a row here"
    refused = {f for f, (_, outcome) in MESSAGE_ROWS.items() if outcome == REFUSE}
    assert refused == set(MESSAGE_REFUSED)
    assert PART_TYPES == set(PART_ROWS) == {"text", *PART_REFUSED}


@pytest.mark.parametrize("field", sorted(MESSAGE_ROWS))
def test_a_message_field_is_used_or_refused_by_its_path(field):
    message, outcome = MESSAGE_ROWS[field]
    expected = (f"messages[1].{field}", "unsupported_parameter") if outcome == REFUSE else None
    assert refused_by(chat_with(message)) == (expected or (None, None))


@pytest.mark.parametrize("kind", sorted(PART_ROWS))
def test_a_content_part_is_used_or_refused_by_its_path(kind):
    part, outcome = PART_ROWS[kind]
    got = refused_by(chat_with({"role": "user", "content": [{"type": "text", "text": "a"}, part]}))
    path = f"messages[1].content[1].{kind}"
    assert got == ((path, "unsupported_parameter") if outcome == REFUSE else (None, None))


@pytest.mark.parametrize("message", MESSAGE_DEFAULTS)
def test_a_message_default_is_accepted(message):
    assert refused_by(chat_with(message)) == (None, None)


@pytest.mark.parametrize(
    ("message", "param", "code"),
    [
        ({"role": "user", "content": "hi", "foo": 1}, "messages[1].foo", "unknown_parameter"),
        ({"role": "user", "content": "hi", "Name": "a"}, "messages[1].Name", "unknown_parameter"),
        (
            {"role": "user", "content": [{"type": "text", "text": "a", "foo": 1}]},
            "messages[1].content[0].foo",
            "unknown_parameter",
        ),
        (
            {"role": "user", "content": [{"type": "video", "video": {}}]},
            "messages[1].content[0].type",
            "unknown_parameter",
        ),
        (
            {"role": "function", "name": "f", "content": "1"},
            "messages[1].role",
            "unsupported_parameter",
        ),
        (
            {"role": "user", "content": [{"type": "text"}]},
            "messages[1].content[0].text",
            "invalid_type",
        ),
        ({"role": "user", "content": None}, "messages[1].content", None),
        ({"role": "robot", "content": "hi"}, "messages[1].role", None),
    ],
)
def test_an_unknown_or_bad_message_field_is_refused_by_its_path(message, param, code):
    assert refused_by(chat_with(message)) == (param, code)


def test_message_text_parts_and_name_reach_the_prompt(replica):
    """Text parts are joined by newlines; the official client sees a nested refusal's path."""
    runtime = replica.runtime
    parts = [{"type": "text", "text": "the"}, {"type": "text", "text": "cat"}]
    joined = parse_request("chat", chat_with({"role": "user", "content": parts, "name": "al"}))
    assert joined.messages[1].model_dump() == {"role": "user", "content": "the\ncat", "name": "al"}
    assert "name" not in joined.messages[0].model_dump()  # only when sent
    assert "the\ncat" in str(runtime.prompt_of(joined))
    assert_answered(
        replica.client.post(PATHS["chat"], json=chat_with(MESSAGE_ROWS["name"][0])), "name"
    )
    client = replica.openai()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**chat_with(MESSAGE_ROWS["function_call"][0]))
    assert refused.value.param == "messages[1].function_call"
    assert refused.value.code == "unsupported_parameter"
