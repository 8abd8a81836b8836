"""The Serve app end to end through the official openai client, with a real Redis and Ray."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from osd.buffer.reader import LogReader
from osd.model_sources import load_model_pair


@pytest.fixture(scope="module")
def client(ray_serve_app):
    base_url, _ = ray_serve_app
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def greedy_text(ray_serve_app):
    _, config = ray_serve_app
    target, _, tokenizer = load_model_pair(config.model)

    def run(prompt: str, max_tokens: int) -> str:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = target.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return run


def test_completion_at_temperature_zero_equals_target_greedy(client, greedy_text):
    for method in ("token", "block", "spectr"):
        response = client.completions.create(
            model="osd",
            prompt="the cat",
            max_tokens=24,
            temperature=0,
            extra_body={"spec": {"method": method, "k": 3}},
        )
        assert response.choices[0].text == greedy_text("the cat", 24)
        assert response.usage.completion_tokens <= 24
        assert response.model_extra["osd"]["method"] == method


def test_chat_and_streaming_match(client):
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(
        model="osd", messages=messages, max_tokens=20, temperature=0
    )
    stream = client.chat.completions.create(
        model="osd",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_records_reach_the_log_buffer_unless_opted_out(client, serving_redis):
    reader = LogReader(serving_redis.url, group="test-records", start_id="$")
    client.completions.create(
        model="osd", prompt="abc", max_tokens=8, seed=1, extra_body={"domain": "code"}
    )
    client.completions.create(
        model="osd",
        prompt="abc",
        max_tokens=8,
        seed=2,
        extra_body={"log": False, "domain": "secret"},
    )
    records, deadline = [], 30
    while deadline and len(records) < 1:
        records += [r for _, r in reader.read(count=10, block_ms=1000)]
        deadline -= 1
    records += [r for _, r in reader.read(count=10, block_ms=1500)]
    assert [r.domain for r in records] == ["code"]
    assert records[0].num_generated == 8 and records[0].adapter_name == "code"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "nope", "prompt": "a"}, 404),
        ({"model": "osd", "prompt": "a", "max_tokens": 100000}, 400),
        ({"model": "osd", "prompt": "a" * 600}, 400),
        ({"model": "osd", "prompt": "a", "temperature": -1}, 400),
        ({"model": "osd", "prompt": "a", "n": 17}, 400),
        ({"model": "osd"}, 400),
    ],
)
def test_bad_requests_get_openai_style_4xx(ray_serve_app, body, status):
    base_url, _ = ray_serve_app
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == status
    assert "message" in response.json()["error"]


def test_malformed_and_oversized_bodies(ray_serve_app):
    base_url, _ = ray_serve_app
    bad = httpx.post(
        f"{base_url}/v1/completions",
        content=b"{nope",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert bad.status_code == 400 and "error" in bad.json()
    huge = httpx.post(
        f"{base_url}/v1/completions",
        content=b"x" * 2_000_000,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert huge.status_code == 413


def test_models_health_and_metrics(ray_serve_app):
    base_url, _ = ray_serve_app
    listed = httpx.get(f"{base_url}/v1/models").json()["data"][0]
    assert listed["id"] == "osd" and listed["created"] > 0
    assert httpx.get(f"{base_url}/v1/models/osd").json() == listed  # models.retrieve
    missing = httpx.get(f"{base_url}/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    health = httpx.get(f"{base_url}/health").json()
    # No trainer runs beside this app: the loop is degraded, and /health says so and why.
    assert health["status"] == "degraded"
    assert health["problems"] == ["trainer: no trainer has reported on this stream"]
    ready = httpx.get(f"{base_url}/ready")
    assert ready.status_code == 200 and ready.json()["checks"]["log_buffer"]["status"] == "ok"
    text = httpx.get(f"{base_url}/metrics").text
    assert "osd_generated_tokens_total" in text
    # Every request by its outcome (earlier tests of this module sent 200s and 400s).
    for status in ("200", "400"):
        assert f'osd_requests_total{{endpoint="/v1/completions",status="{status}"}}' in text
    # vLLM's names beside osd's (serving/vllm_metrics.py), labelled with the served model.
    for name in ("vllm:num_requests_running", "vllm:spec_decode_num_drafts_total"):
        assert f'{name}{{engine="0",model_name="osd"}}' in text


def test_concurrent_requests_share_decode_steps_and_stay_exact(ray_serve_app, greedy_text):
    """Clients at once are rows of the same batched steps, each still the target's greedy."""
    import threading

    base_url, _ = ray_serve_app

    def decode_counts() -> tuple[float, float]:
        text = httpx.get(f"{base_url}/metrics").text
        values = {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith(("osd_decode_steps ", "osd_batch_mean_rows "))
        }
        steps = values["osd_decode_steps"]
        return steps, steps * values["osd_batch_mean_rows"]

    prompts = ["the cat", "a dog ran", "hello there", "one two"]
    methods = ["block", "token", "spectr", "none"]
    texts: dict[str, str] = {}
    steps_before, rows_before = decode_counts()
    start = threading.Barrier(len(prompts))

    def one(prompt: str, method: str) -> None:
        start.wait()
        response = httpx.post(
            f"{base_url}/v1/completions",
            json={
                "model": "osd",
                "prompt": prompt,
                "max_tokens": 40,
                "temperature": 0,
                "spec": {"method": method},
            },
            timeout=120,
        )
        texts[prompt] = response.json()["choices"][0]["text"]

    threads = [
        threading.Thread(target=one, args=pair) for pair in zip(prompts, methods, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for prompt in prompts:
        assert texts[prompt] == greedy_text(prompt, 40), prompt
    steps_after, rows_after = decode_counts()
    mean_rows = (rows_after - rows_before) / (steps_after - steps_before)
    assert mean_rows > 1.3, mean_rows  # one request alone would be 1.0


def test_auto_draft_length_over_http_is_exact_and_measured(ray_serve_app, greedy_text):
    base_url, _ = ray_serve_app
    body = {"model": "osd", "prompt": "the cat", "max_tokens": 30, "temperature": 0}
    response = httpx.post(
        f"{base_url}/v1/completions", json={**body, "spec": {"k": "auto"}}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == greedy_text("the cat", 30)
    bad = httpx.post(f"{base_url}/v1/completions", json={**body, "spec": {"k": "most"}}, timeout=60)
    assert bad.status_code == 400
    assert "osd_draft_length_chosen_bucket" in httpx.get(f"{base_url}/metrics").text


def test_a_request_pins_its_proposer_and_sees_the_mix(ray_serve_app, greedy_text):
    """spec.proposer over HTTP: every choice exact, the osd block says who drafted, the
    Prometheus counters count per proposer, and an unknown proposer is a 400 naming it."""
    base_url, _ = ray_serve_app
    prompt = "the cat the cat the cat the cat"
    body = {"model": "osd", "prompt": prompt, "max_tokens": 30, "temperature": 0}
    for proposer in ("ngram", "suffix", "draft", "auto"):
        response = httpx.post(
            f"{base_url}/v1/completions",
            json={**body, "spec": {"proposer": proposer, "k": "auto"}},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["text"] == greedy_text(prompt, 30), proposer
        mix = answer["osd"]["proposers"]
        assert set(mix) <= {"draft", "suffix", "ngram"}
        if proposer in ("ngram", "suffix"):
            assert set(mix) <= {proposer} and mix.get(proposer, {}).get("drafted", 0) > 0, mix
    bad = httpx.post(
        f"{base_url}/v1/completions", json={**body, "spec": {"proposer": "eagle"}}, timeout=60
    )
    assert bad.status_code == 400 and "proposer" in bad.text
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'osd_proposer_drafted_tokens_total{proposer="ngram"}' in metrics


def test_penalties_and_logit_bias_reach_the_engine(ray_serve_app, client):
    """Greedy with penalties over HTTP is the target alone with the same penalties (Python
    API, speculation off); a +100 logit bias forces its token; a token id outside the
    vocabulary is a 400 naming logit_bias."""
    from osd import SpeculativeDecoder

    _, config = ray_serve_app
    target, draft, tokenizer = load_model_pair(config.model)
    alone = SpeculativeDecoder(target, draft, tokenizer)
    options = {"repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.3}
    expected = alone.generate("the cat", max_tokens=16, temperature=0, method="none", **options)
    response = client.completions.create(
        model="osd",
        prompt="the cat",
        max_tokens=16,
        temperature=0,
        presence_penalty=0.3,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.5, "spec": {"method": "block", "k": 3}},
    )
    assert response.choices[0].text == expected.text
    forced = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" dog"))[-1]
    response = client.completions.create(
        model="osd", prompt="the cat", max_tokens=4, logit_bias={str(forced): 100}, seed=1
    )
    assert response.choices[0].text == tokenizer.decode([forced] * 4)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="osd", prompt="x", logit_bias={str(10**6): 1})
    assert refused.value.body["param"] == "logit_bias"


def test_a_chat_without_max_tokens_gets_what_the_context_leaves(client, ray_serve_app):
    """OpenAI's chat has no default budget of 16 tokens (the completions endpoint's): a chat
    that names none may fill the context (up to serve.max_tokens_limit)."""
    _, config = ray_serve_app
    response = client.chat.completions.create(
        model="osd",
        messages=[{"role": "user", "content": "hello"}],
        temperature=0,
        extra_body={"ignore_eos": True, "spec": {"method": "none"}},
    )
    usage = response.usage
    context = 512  # the toy models' positions
    assert usage.completion_tokens == min(
        context - usage.prompt_tokens, config.serve.max_tokens_limit
    )
    assert response.choices[0].finish_reason == "length"


def test_a_budget_over_the_context_is_refused_not_cut(ray_serve_app):
    """A prompt and a named max_tokens beyond the context: 400 naming max_tokens (OpenAI's
    and vLLM's answer), not a shorter completion that looks like a whole one."""
    base_url, _ = ray_serve_app
    body = {"model": "osd", "prompt": "a" * 200, "max_tokens": 400, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "context" in error["message"]


def test_bodies_nested_too_deep_or_with_unencodable_text_anywhere_are_400(ray_serve_app):
    base_url, _ = ray_serve_app
    deep = b'{"model": "osd", "prompt": "a", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    tool = {
        "type": "function",
        "function": {"name": "f", "description": "\ud800", "parameters": {"type": "object"}},
    }
    chat = {"model": "osd", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    for path, content in (
        ("/v1/completions", deep),
        ("/v1/chat/completions", json.dumps(chat).encode()),  # "\ud800" escaped, valid JSON
    ):
        response = httpx.post(
            f"{base_url}{path}",
            content=content,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert response.status_code == 400, response.text
        assert "error" in response.json()
    refused = response.json()["error"]
    assert refused["param"] == "tools[0].function.description"


def test_stream_options_continuous_usage_and_without_a_stream(ray_serve_app, client):
    stream = client.completions.create(
        model="osd",
        prompt="the cat",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 12  # the tokens so far, every chunk
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    base_url, _ = ray_serve_app
    body = {"model": "osd", "prompt": "a", "stream_options": {"include_usage": True}}
    refused = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"


def test_refusals_name_the_field_as_the_request_spells_it(ray_serve_app):
    base_url, _ = ray_serve_app
    hi = [{"role": "user", "content": "hi"}]
    for body, param in (
        ({"messages": hi, "max_completion_tokens": 100000}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "a " * 600}]}, "messages"),
    ):
        response = httpx.post(
            f"{base_url}/v1/chat/completions", json={"model": "osd", **body}, timeout=30
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == param
