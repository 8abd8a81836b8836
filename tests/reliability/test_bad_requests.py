"""Property-based fuzzing of the OpenAI-compatible API: whatever a client sends, the answer is a
200 or an OpenAI-style 4xx, never a 500 and never a hang.

Bodies mix valid fields with wrong types, out-of-range numbers, unknown fields, huge and empty
strings, lone surrogates, NaN, nested garbage, non-object JSON, wrong content types and raw bytes.
The replica logs to a real Redis, so record building is fuzzed too (a request whose record cannot
be built must be refused up front, not fail after decoding). docs/reliability.md, "bad requests".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from .conftest import running_replica, toy_config

TIMEOUT_S = 20.0  # per request; an 8-token toy request takes ~50 ms

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # NaN and infinities too: json.dumps writes them, json.loads reads them
    st.text(max_size=12),
    st.sampled_from(["", "\ud800", "\x00", "osd", "general", "code", "é" * 129]),
)
garbage = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=10,
)
# Empty, one character, over the toy context (512), and over serve.max_body_bytes (1 MB).
huge_text = st.sampled_from([0, 1, 600, 20_000, 1_100_000]).map(lambda n: "ab " * (n // 3))
# Text a tokenizer may choke on: lone surrogates (JSON can escape them), NUL, odd scripts.
odd_text = st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u202e\u0301", "😀" * 40, "\r\n" * 9])
big_ints = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]) | st.integers()

MAIN_FIELDS = ("prompt", "messages")  # completions / chat
# Per field: (values a well-behaved client sends, values at or past the edges of the same type).
FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "model": (st.just("osd"), st.sampled_from(["gpt-4o", "", "OSD"])),
    "prompt": (
        st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 63), min_size=1, max_size=20),
        huge_text
        | odd_text
        | st.lists(st.integers(-3, 70), max_size=20)
        | st.lists(st.text(max_size=8) | odd_text),
    ),
    "messages": (
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["system", "user", "assistant"]),
                    "content": st.text(max_size=30),
                },
                optional={"name": st.text(max_size=8)},
            ),
            min_size=1,
            max_size=4,
        ),
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "bot"]) | st.text(max_size=9),
                    "content": huge_text | odd_text | st.text(),
                }
            ),
            max_size=3,
        ),
    ),
    "max_tokens": (st.integers(1, 8), big_ints),
    "max_completion_tokens": (st.integers(1, 8), st.integers(-2, 12)),
    "temperature": (
        st.floats(0, 2),
        st.floats(-1, 3) | st.sampled_from([1e-300, 5e-324, 1e-40, 1e-6]),
    ),
    "top_p": (st.floats(0, 1, exclude_min=True), st.floats(-0.5, 1.5) | st.just(1e-300)),
    "top_k": (st.integers(0, 100), big_ints),
    "stop": (
        st.text(max_size=8) | st.lists(st.text(max_size=8), max_size=4),
        st.text(max_size=70) | odd_text | st.lists(st.text(max_size=70) | odd_text, max_size=6),
    ),
    "seed": (st.integers(0, 2**32), big_ints),
    "n": (st.just(1), st.integers()),
    "stream": (st.booleans(), st.none()),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), st.just({})),
    "user": (st.text(max_size=20), st.text(max_size=300) | odd_text),
    "draft": (st.sampled_from(["general", "code", "nope"]), st.text(max_size=200)),
    "domain": (
        st.from_regex(r"[a-z0-9_.-]{0,20}", fullmatch=True),
        st.text(max_size=140) | odd_text,
    ),
    "spec": (
        st.fixed_dictionaries(
            {},
            optional={
                "method": st.sampled_from(["token", "block", "spectr", "none"]),
                "k": st.integers(1, 8),
                "K": st.integers(1, 4),
            },
        ),
        st.fixed_dictionaries(
            {},
            optional={"method": st.text(), "k": st.integers(), "K": st.integers(), "x": garbage},
        ),
    ),
    "log": (st.booleans(), st.sampled_from([0, 1, "false", "no"])),
}


def bodies(main_field: str) -> st.SearchStrategy[dict[str, Any]]:
    """A well-behaved body, then up to two fields set to edge values or garbage, or removed,
    plus maybe unknown fields: both the deep paths (200s) and each field's checks are hit."""
    # max_tokens is required here only because the toy server's limit (8) is below the default.
    required = {k: FIELDS[k][0] for k in ("model", "max_tokens", main_field)}
    optional = {k: good for k, (good, _) in FIELDS.items() if k not in (*required, *MAIN_FIELDS)}
    typed = st.fixed_dictionaries(required, optional=optional)
    name = st.sampled_from(sorted(FIELDS))
    breaks = st.lists(
        name.flatmap(lambda n: st.tuples(st.just(n), FIELDS[n][1] | garbage | st.just(...))),
        max_size=2,
    )
    unknown = st.dictionaries(st.text(max_size=10), garbage, max_size=2)

    def build(body: dict[str, Any], broken: list[tuple[str, Any]], extra: dict[str, Any]):
        body = {**extra, **body}
        for key, value in broken:
            if value is ...:
                body.pop(key, None)
            else:
                body[key] = value
        return body

    return st.builds(build, typed, breaks, unknown)


def requests(main_field: str) -> st.SearchStrategy[tuple]:
    """(content bytes, content-type or None): mostly JSON objects, else anything."""
    as_json = bodies(main_field).map(lambda b: json.dumps(b, allow_nan=True).encode())
    other_json = garbage.map(lambda b: json.dumps(b, allow_nan=True).encode())
    content = st.one_of(*[as_json] * 6, other_json, st.binary(max_size=300))
    content_type = st.sampled_from(
        [
            "application/json",
            "application/json",
            None,
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ]
    )
    return st.tuples(content, content_type)


@pytest.fixture(scope="module")
def app(module_redis) -> Iterator[Any]:
    config = toy_config("serve.max_ongoing_requests=64")
    with running_replica(config, redis_url=module_redis.url) as replica:
        yield replica.client.app


async def _post(app: Any, path: str, content: bytes, content_type: str | None) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        return await asyncio.wait_for(
            client.post(path, content=content, headers=headers), TIMEOUT_S
        )


def check_answer(response: httpx.Response, sent: bytes) -> None:
    status = response.status_code
    event(f"status {status}")
    assert status == 200 or 400 <= status < 500, (status, response.text[:300], sent[:300])
    if status == 200 and response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n"), response.text[-300:]
        assert "server_error" not in response.text, response.text[-300:]
        return
    body = response.json()
    if status == 200:
        assert body["choices"] and "usage" in body, body
        return
    error = body["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str), body


FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,  # no .hypothesis folder in the repository
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(request=requests("prompt"))
def test_completions_answer_any_body_with_200_or_openai_4xx(app, request):
    content, content_type = request
    response = asyncio.run(_post(app, "/v1/completions", content, content_type))
    check_answer(response, content)


@FUZZ
@given(request=requests("messages"))
def test_chat_completions_answer_any_body_with_200_or_openai_4xx(app, request):
    content, content_type = request
    response = asyncio.run(_post(app, "/v1/chat/completions", content, content_type))
    check_answer(response, content)
