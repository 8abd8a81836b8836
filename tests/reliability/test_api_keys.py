"""API keys: with serve.api_keys every /v1/* route wants a bearer key; tested with the official
OpenAI client (right key, wrong key, none) against a Ray-free replica."""

from __future__ import annotations

import logging

import openai
import pytest

from osd.config import load_config
from serving.app import build_app

from .conftest import running_replica, toy_config

KEYS = "serve.api_keys=[k-first-0123456789, k-second-0123456789]"


def client(replica, api_key: str) -> openai.OpenAI:
    # Starlette's TestClient is an httpx.Client: the official client talks to the app in process.
    return replica.openai(api_key)


def test_the_official_client_needs_one_of_the_keys(caplog):
    caplog.set_level(logging.DEBUG)
    with running_replica(toy_config(KEYS)) as replica:
        for key in ("k-first-0123456789", "k-second-0123456789"):
            out = client(replica, key).completions.create(
                model="osd", prompt="the cat", max_tokens=4, temperature=0
            )
            assert out.usage.completion_tokens >= 1
        assert [m.id for m in client(replica, "k-second-0123456789").models.list()] == ["osd"]
        for wrong in ("k-first-01234567890", "nope", "K-FIRST-0123456789"):
            with pytest.raises(openai.AuthenticationError) as refused:
                client(replica, wrong).chat.completions.create(
                    model="osd", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
            assert refused.value.status_code == 401
            assert refused.value.body["code"] == "invalid_api_key"
        answer = client(replica, "k-first-0123456789").responses.create(
            model="osd", input="the cat", max_output_tokens=4
        )
        assert answer.usage.output_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            client(replica, "nope").responses.create(model="osd", input="x")
        none = replica.client.post("/v1/completions", json={"model": "osd", "prompt": "x"})
        assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
        stored = replica.client.get("/v1/responses/resp_1")
        assert stored.status_code == 401  # not even whether it exists, without a key
        assert none.json()["error"]["type"] == "invalid_request_error"
        # Liveness and metrics stay open to probes and scrapers.
        assert replica.client.get("/health").status_code == 200
        assert replica.client.get("/metrics").status_code == 200
    assert "k-first-0123456789" not in caplog.text and "k-second" not in caplog.text


def test_no_keys_on_a_public_address_is_refused_unless_asked_for(monkeypatch):
    monkeypatch.delenv("OSD_API_KEYS", raising=False)
    public = load_config(None, ["serve.host=0.0.0.0"])  # a trainer may read it: no check there
    with pytest.raises(ValueError, match="serve.allow_unauthenticated") as refused:
        build_app(public)  # what osd serve / up / demo start
    assert "api_keys" in str(refused.value)
    for allowed in ("serve.allow_unauthenticated=true", "serve.api_keys=[k]"):
        load_config(None, ["serve.host=0.0.0.0", allowed]).serve.check_access()
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        load_config(None, [f"serve.host={host}"]).serve.check_access()
    with pytest.raises(ValueError, match="surrounding spaces"):
        load_config(None, ["serve.api_keys=[' padded']"])


def test_keys_come_from_the_environment_when_the_config_names_none(monkeypatch):
    monkeypatch.setenv("OSD_API_KEYS", " env-key-1 ,env-key-2,")
    config = load_config("configs/production.yaml")  # serves on 0.0.0.0: keys required
    assert config.serve.api_keys == ("env-key-1", "env-key-2")
    config.serve.check_access()
    named = load_config(None, ["serve.api_keys=[from-config]"])
    assert named.serve.api_keys == ("from-config",)
