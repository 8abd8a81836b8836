"""n choices over HTTP with the official client: each choice is the request with its derived
seed, streamed equals non-streamed, usage sums the choices, and each choice is logged as its
own record (issue 14, item 4)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from osd.buffer.reader import LogReader
from osd.decode.choices import choice_seed
from tests.reliability.conftest import Replica, running_replica, toy_config, wait_for

PROMPT = "the cat sat"
MESSAGES = [{"role": "user", "content": "hi there"}]
SEED = 11
N = 3


@pytest.fixture(scope="module")
def replica(serving_redis) -> Iterator[Replica]:
    with running_replica(toy_config(), redis_url=serving_redis.url) as replica:
        yield replica


def create(client, kind: str, **fields):
    if kind == "chat":
        return client.chat.completions.create(model="osd", messages=MESSAGES, **fields)
    return client.completions.create(model="osd", prompt=PROMPT, **fields)


def text_of(kind: str, choice) -> str:
    return choice.message.content if kind == "chat" else choice.text


def streamed(client, kind: str, **fields) -> tuple[dict[int, str], dict[int, str], object]:
    """Each choice's text and finish reason, reassembled by index, and the usage."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in create(
        client, kind, stream=True, stream_options={"include_usage": True}, **fields
    ):
        for choice in chunk.choices:
            piece = choice.delta.content if kind == "chat" else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    return texts, finish, usage


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_n_choices_are_the_requests_with_derived_seeds_streamed_and_not(client, kind):
    fields = dict(max_tokens=8, temperature=1.0, seed=SEED)
    whole = create(client, kind, n=N, **fields)
    assert [c.index for c in whole.choices] == list(range(N))
    alone = [create(client, kind, **{**fields, "seed": choice_seed(SEED, i)}) for i in range(N)]
    assert [text_of(kind, c) for c in whole.choices] == [text_of(kind, a.choices[0]) for a in alone]
    assert len({text_of(kind, c) for c in whole.choices}) == N  # independent samples
    # OpenAI's usage: the prompt once, every choice's completion tokens.
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    texts, finish, usage = streamed(client, kind, n=N, **fields)
    assert [texts[i] for i in range(N)] == [text_of(kind, c) for c in whole.choices]
    assert [finish[i] for i in range(N)] == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_each_choice_is_logged_as_its_own_record(client, serving_redis):
    reader = LogReader(serving_redis.url, group="test-choices", start_id="$")
    create(client, "completion", n=N, max_tokens=8, seed=SEED, extra_body={"domain": "code"})
    records, tries = [], 30
    while tries and len(records) < N:
        records += [r for _, r in reader.read(count=10, block_ms=1000)]
        tries -= 1
    assert sorted(r.seed for r in records) == sorted(choice_seed(SEED, i) for i in range(N))
    assert len({r.request_id for r in records}) == 1  # one request: held out together
    assert all(r.domain == "code" and r.num_generated == 8 for r in records)


def test_n_with_logprobs_gives_every_choice_its_own(client):
    out = create(client, "completion", n=2, max_tokens=6, seed=SEED, logprobs=1)
    for i, choice in enumerate(out.choices):
        alone = create(client, "completion", max_tokens=6, seed=choice_seed(SEED, i), logprobs=1)
        expected = alone.choices[0].logprobs
        assert choice.logprobs.tokens == expected.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(expected.token_logprobs, abs=1e-5)


@pytest.mark.parametrize("n", [0, 17, "2", 1.5])
def test_n_out_of_range_is_refused_naming_it(replica, n):
    response = replica.client.post(
        "/v1/completions", json={"model": "osd", "prompt": PROMPT, "n": n}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"


def test_best_of_stays_refused_by_name(replica):
    response = replica.client.post(
        "/v1/completions", json={"model": "osd", "prompt": PROMPT, "n": 2, "best_of": 3}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "best_of"


def test_more_choices_than_the_kv_slots_hold_is_a_400_naming_n(replica):
    slots = replica.runtime.batch.limits.num_slots  # spectr with K = 2: two slots per choice
    body = {
        "model": "osd",
        "prompt": PROMPT,
        "n": slots // 2 + 1,
        "max_tokens": 4,
        "spec": {"method": "spectr", "K": 2},
    }
    response = replica.client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"


def test_n_choices_count_their_prompt_once_under_vllm_names(replica, client):
    """vllm:prompt_tokens counts one prefill per request, however many choices share it."""

    def counts() -> tuple[float, float]:
        values = {"vllm:prompt_tokens_total": 0.0, "vllm:request_success_total": 0.0}
        for line in replica.metrics().splitlines():
            name = line.split("{")[0]
            if name in values:  # summed over finished_reason
                values[name] += float(line.split()[-1])
        return values["vllm:prompt_tokens_total"], values["vllm:request_success_total"]

    prompt_before, done_before = counts()
    result = client.completions.create(model="osd", prompt=PROMPT, n=N, max_tokens=4, seed=SEED)
    prompt_after, done_after = counts()
    assert prompt_after - prompt_before == result.usage.prompt_tokens
    assert done_after - done_before == N  # each choice finishes as a request of its own


PROMPTS = ["the cat sat", "a dog ran far"]


def test_several_prompts_are_each_completed_and_numbered_prompt_by_prompt(client):
    """OpenAI's list of prompts: prompt i's choice j is choice i * n + j, each the request of
    that prompt alone; usage sums them; streamed equals whole."""
    fields = dict(model="osd", max_tokens=8, temperature=1.0, seed=SEED, n=2)
    whole = client.completions.create(prompt=PROMPTS, **fields)
    alone = [client.completions.create(prompt=prompt, **fields) for prompt in PROMPTS]
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [c.text for a in alone for c in a.choices]
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    texts: dict[int, str] = {}
    usage = None
    options = {"include_usage": True}
    for chunk in client.completions.create(
        prompt=PROMPTS, stream=True, stream_options=options, **fields
    ):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_prompts_of_token_ids_are_each_echoed_and_scored(client):
    ids = [[5, 6, 7], [8, 9]]
    fields = dict(model="osd", max_tokens=4, temperature=0.0, echo=True, logprobs=1)
    whole = client.completions.create(prompt=ids, **fields)
    alone = [client.completions.create(prompt=prompt, **fields).choices[0] for prompt in ids]
    assert [c.text for c in whole.choices] == [a.text for a in alone]
    assert [c.logprobs.tokens for c in whole.choices] == [a.logprobs.tokens for a in alone]


@pytest.mark.parametrize("prompt", [["a", ""], [[1, 2], []], ["a", [1, 2]], []])
def test_a_list_of_prompts_with_an_empty_or_mixed_one_is_refused(replica, prompt):
    response = replica.client.post("/v1/completions", json={"model": "osd", "prompt": prompt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("prompt")


def test_a_refused_prompt_gives_back_the_ones_admitted_before_it(replica):
    admission = replica.runtime._admission
    free = admission._value
    too_long = "the cat sat " * 4000
    body = {"model": "osd", "prompt": ["the cat sat", too_long], "max_tokens": 4}
    response = replica.client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    # the first prompt's job ends on the event loop
    wait_for(lambda: admission._value == free, timeout_s=5, interval_s=0.05)
    ok = replica.client.post("/v1/completions", json={**body, "prompt": PROMPTS})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_each_choices_text_offsets_count_from_its_own_text(client):
    fields = dict(model="osd", prompt=PROMPT, n=2, max_tokens=6, seed=SEED, logprobs=1)
    whole = client.completions.create(**fields)
    for choice in whole.choices:  # as the choice's request alone has them
        alone = client.completions.create(
            **{**fields, "n": 1, "seed": choice_seed(SEED, choice.index)}
        )
        assert choice.logprobs.text_offset == alone.choices[0].logprobs.text_offset
    streamed_offsets: dict[int, list[int]] = {}
    for chunk in client.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed_offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset)
    assert streamed_offsets == {c.index: c.logprobs.text_offset for c in whole.choices}
