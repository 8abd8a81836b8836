"""logprobs over HTTP with the official client: OpenAI's shapes, streamed and not, and the
numbers equal the target alone's (issue 14, item 3)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.reliability.conftest import Replica, running_replica, toy_config

PROMPT = "the cat sat"
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def replica() -> Iterator[Replica]:
    with running_replica(toy_config()) as replica:
        yield replica


def target_logprobs(replica, token_ids: list[int]) -> torch.Tensor:
    """The target alone's log-softmax after each generated token's prefix: (T, V)."""
    engine = replica.runtime.engine
    prompt = list(engine.tokenizer(PROMPT)["input_ids"])
    with torch.no_grad():
        logits = engine.target.model(torch.tensor([prompt + token_ids])).logits
    return torch.log_softmax(logits[0, len(prompt) - 1 : -1, : engine.vocab_size].float(), -1)


def test_completion_logprobs_equal_the_target_alone_streamed_and_not(replica, client):
    out = client.completions.create(
        model="osd", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2
    )
    assert isinstance(out, Completion)
    lp = out.choices[0].logprobs
    num = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num > 0
    ids = replica.runtime.engine.generate(PROMPT, max_tokens=8, temperature=0).token_ids
    decode = replica.runtime.engine.tokenizer.decode
    assert lp.tokens == [decode([t]) for t in ids]
    expected = target_logprobs(replica, ids)
    want = expected.gather(1, torch.tensor(ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), want, atol=1e-4, rtol=0)
    for t, (token, top) in enumerate(zip(lp.tokens, lp.top_logprobs, strict=True)):
        values, top_ids = expected[t].topk(2)
        assert set(top) == {decode([i]) for i in top_ids.tolist()} | {token}
        assert top[token] == pytest.approx(max(top.values()))  # greedy: the most likely
        torch.testing.assert_close(
            sorted(top.values(), reverse=True)[:2], values.tolist(), atol=1e-4, rtol=0
        )
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:t]) for t in range(num)]

    chunks = list(
        client.completions.create(
            model="osd", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, stream=True
        )
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    torch.testing.assert_close(
        [x for s in streamed for x in s.token_logprobs], lp.token_logprobs, atol=1e-5, rtol=0
    )


def test_completions_take_up_to_vllms_twenty_alternatives(client):
    # OpenAI stops at 5; a client written for vLLM asks for more.
    out = client.completions.create(model="osd", prompt=PROMPT, max_tokens=3, logprobs=10)
    # The chosen token is listed beside them where it is not among them (OpenAI's n + 1);
    # alternatives whose texts are alike share a key.
    assert all(5 < len(top) <= 11 for top in out.choices[0].logprobs.top_logprobs)


def test_chat_logprobs_shapes_streamed_and_not(client):
    kwargs = dict(model="osd", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True)
    out = client.chat.completions.create(top_logprobs=3, **kwargs)
    assert isinstance(out, ChatCompletion)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens > 0
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert [e.logprob for e in entry.top_logprobs] == sorted(
            (e.logprob for e in entry.top_logprobs), reverse=True
        )
    chunks = list(client.chat.completions.create(top_logprobs=3, stream=True, **kwargs))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    torch.testing.assert_close(
        [e.logprob for e in streamed], [e.logprob for e in content], atol=1e-5, rtol=0
    )
    # logprobs: true alone gives each token's logprob and no alternatives.
    alone = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert alone and all(e.top_logprobs == [] for e in alone)


def test_a_request_without_logprobs_gets_null(replica):
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        for stream in (False, True):
            response = replica.client.post(
                path, json={"model": "osd", "max_tokens": 4, "stream": stream, **body}
            )
            assert response.status_code == 200
            if stream:
                events = [line for line in response.text.split("\n") if line.startswith("data: {")]
                assert events and all('"logprobs": null' in e for e in events)
            else:
                assert response.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "echo": 1}, "echo"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1, "echo": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 2}, "logprobs"),
    ],
)
def test_bad_logprobs_values_are_400_naming_the_field(replica, path, fields, param):
    response = replica.client.post(path, json={"model": "osd", "max_tokens": 2} | fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def prompt_logprobs(replica) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and the target alone's logprob of each after the first: (L - 1,)."""
    engine = replica.runtime.engine
    prompt = list(engine.tokenizer(PROMPT)["input_ids"])
    with torch.no_grad():
        logits = engine.target.model(torch.tensor([prompt])).logits[0, :-1, : engine.vocab_size]
    expected = torch.log_softmax(logits.float(), -1)
    return prompt, expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def test_echo_puts_the_prompt_and_its_logprobs_first_streamed_and_not(replica, client):
    kwargs = dict(model="osd", prompt=PROMPT, max_tokens=6, temperature=0)
    plain = client.completions.create(logprobs=2, **kwargs).choices[0]
    echoed = client.completions.create(echo=True, **kwargs).choices[0]
    assert echoed.text == PROMPT + plain.text and echoed.logprobs is None
    out = client.completions.create(echo=True, logprobs=2, **kwargs)
    choice, lp = out.choices[0], out.choices[0].logprobs
    assert choice.text == PROMPT + plain.text
    prompt, want = prompt_logprobs(replica)
    decode = replica.runtime.engine.tokenizer.decode
    assert out.usage.prompt_tokens == len(prompt)  # usage counts the completion alone
    assert out.usage.completion_tokens == len(plain.logprobs.tokens)
    assert lp.tokens == [decode([t]) for t in prompt] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it
    got = torch.tensor(lp.token_logprobs[1 : len(prompt)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for t in range(1, len(prompt)):  # the prompt token and the 2 most likely
        assert lp.top_logprobs[t][lp.tokens[t]] == lp.token_logprobs[t]
        assert 2 <= len(lp.top_logprobs[t]) <= 3
    torch.testing.assert_close(
        lp.token_logprobs[len(prompt) :], plain.logprobs.token_logprobs, atol=1e-5, rtol=0
    )
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:t]) for t in range(len(lp.tokens))]

    chunks = list(client.completions.create(echo=True, logprobs=2, stream=True, **kwargs))
    assert chunks[0].choices[0].text.startswith(PROMPT)  # the prompt comes in the first chunk
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert streamed[0].tokens[: len(prompt)] == lp.tokens[: len(prompt)]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    flat = [x for s in streamed for x in s.token_logprobs]
    assert flat[0] is None
    torch.testing.assert_close(flat[1:], lp.token_logprobs[1:], atol=1e-5, rtol=0)


def test_max_tokens_0_with_echo_scores_the_prompt(replica, client):
    kwargs = dict(model="osd", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    out = client.completions.create(**kwargs)
    prompt, want = prompt_logprobs(replica)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(prompt)
    assert len(choice.logprobs.tokens) == len(prompt)
    torch.testing.assert_close(
        torch.tensor(choice.logprobs.token_logprobs[1:]), want, atol=1e-4, rtol=0
    )
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == choice.logprobs.tokens
    # Token ids as the prompt: the echo is their decoding.
    ids = client.completions.create(model="osd", prompt=prompt, max_tokens=0, echo=True)
    assert ids.choices[0].text == replica.runtime.engine.tokenizer.decode(
        prompt, skip_special_tokens=True
    )


def test_special_tokens_take_no_text_offset():
    """An echoed prompt's BOS is among the tokens but not in the text: it takes no offset."""
    from osd.decode.generation import TokenLogprob
    from osd.demo.recipe import TokenizerRecipe
    from osd.demo.vocab import train_tokenizer
    from serving.logprobs import LogprobFormatter

    tokenizer = train_tokenizer(["hello world the cat"] * 20, TokenizerRecipe(vocab_size=300))
    ids = tokenizer("hello world")["input_ids"]
    assert tokenizer.decode(ids[:1]) == "<|bos|>"
    entries = [None] + [TokenLogprob(-1.0, ()) for _ in ids[1:]]
    formatted = LogprobFormatter(tokenizer, chat=False).format(ids, entries)
    assert formatted is not None
    text = "hello world"
    for token, offset in zip(formatted["tokens"][1:], formatted["text_offset"][1:], strict=True):
        assert text[offset : offset + len(token)] == token
    assert formatted["text_offset"][:2] == [0, 0]


@pytest.mark.parametrize("chat", [True, False])
def test_a_character_split_over_tokens_keeps_its_bytes_and_its_offset(chat):
    """Byte-level BPE splits a rare character into byte tokens: each shows its bytes escaped,
    chat's ``bytes`` join into the text, and offsets count characters of the text."""
    from osd.decode.generation import TokenLogprob
    from osd.demo.recipe import TokenizerRecipe
    from osd.demo.vocab import train_tokenizer
    from serving.logprobs import LogprobFormatter

    tokenizer = train_tokenizer(["hello world the cat"] * 20, TokenizerRecipe(vocab_size=300))
    text = "a日本 b"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text)  # the characters are split
    entries = [
        TokenLogprob(-1.0, tuple((i, -2.0 - j) for j, i in enumerate(ids[1:4]))) for _ in ids
    ]
    formatter = LogprobFormatter(tokenizer, chat=chat)
    halves = [formatter.format(ids[:3], entries[:3]), formatter.format(ids[3:], entries[3:])]
    if chat:
        content = [c for half in halves for c in half["content"]]
        assert b"".join(bytes(c["bytes"]) for c in content).decode() == text
        assert "\ufffd" not in "".join(c["token"] for c in content)
        assert len({alt["token"] for alt in content[0]["top_logprobs"]}) == 3
        assert content[1]["token"].startswith("\\x")  # the first byte of 日, escaped
    else:
        tokens = [t for half in halves for t in half["tokens"]]
        offsets = [o for half in halves for o in half["text_offset"]]
        # a, then 日 and 本 three bytes each (each byte starts where its character does)
        assert tokens[:7] == ["a", "\\xe6", "\\x97", "\\xa5", "\\xe6", "\\x9c", "\\xac"]
        assert offsets[:7] == [0, 1, 1, 1, 2, 2, 2]
        assert text[offsets[7] :].startswith("".join(tokens[7:]))
        assert len(halves[0]["top_logprobs"][0]) == 4  # three alternatives apart, and "a"
        # A lead byte nothing completes reads as U+FFFD; what follows starts after it.
        lead, a = ids[1], ids[0]
        dangling = LogprobFormatter(tokenizer, chat=False).format([a, lead, a, a], entries[:4])
        assert tokenizer.decode([a, lead, a, a]) == "a\ufffdaa"
        assert dangling["text_offset"] == [0, 1, 2, 3]
