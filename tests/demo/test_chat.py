"""The demo's chat format: the tokenizer's template renders as the corpus's dialogues, round-trips,
and chat prompts tokenize as a prefix of a training dialogue, its reply ending in EOS."""

from __future__ import annotations

import random

import pytest
from jinja2 import TemplateError
from transformers import AutoTokenizer

from osd.demo import CHAT_TEMPLATE, load_corpus_split, parse_chat, render_chat
from osd.demo.corpus import heldout_dialogues
from osd.demo.dialogues import json_dialogue, math_dialogue, sql_dialogue
from osd.demo.recipe import CHAT_TOPICS, ROLE_TOKENS
from osd.demo.training import encode_streams

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3 * 4?"}],
    [
        {"role": "system", "content": "You write SQL for the shop database."},
        {"role": "user", "content": "Write a query for the titles of products."},
        {"role": "assistant", "content": "SELECT title FROM products;"},
        {"role": "user", "content": "Now the number of orders."},
    ],
    [{"role": "developer", "content": "Answer in JSON."}, {"role": "user", "content": "déjà 🙂"}],
]


@pytest.fixture(scope="module")
def tokenizer(tiny_paths):
    return AutoTokenizer.from_pretrained(tiny_paths.tokenizer)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_tokenizer_template_renders_as_the_corpus_does(tokenizer, messages, generation_prompt):
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    assert rendered == render_chat(messages, add_generation_prompt=generation_prompt)
    assert rendered.endswith("<|assistant|>\n") == generation_prompt
    assert not rendered.startswith("<|bos|>")  # the tokenizer prepends it when encoding


def test_every_saved_tokenizer_carries_the_template(tiny_paths):
    for directory in (tiny_paths.tokenizer, tiny_paths.target, tiny_paths.draft):
        assert AutoTokenizer.from_pretrained(directory).chat_template == CHAT_TEMPLATE


def test_the_assistant_turn_ends_with_eos_and_roles_are_markers():
    text = render_chat(CONVERSATIONS[1][:3])
    assert text == (
        "<|system|>\nYou write SQL for the shop database.\n"
        "<|user|>\nWrite a query for the titles of products.\n"
        "<|assistant|>\nSELECT title FROM products;<|endoftext|>"
    )


def test_unknown_roles_are_refused_by_both_renderings(tokenizer):
    messages = [{"role": "tool", "content": "42"}]
    with pytest.raises(ValueError, match="not 'tool'"):
        render_chat(messages)
    with pytest.raises(TemplateError, match="not tool"):
        tokenizer.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("messages", CONVERSATIONS[:2])
def test_parse_inverts_render(messages):
    for generation_prompt in (True, False):
        parsed, prompt = parse_chat(render_chat(messages, add_generation_prompt=generation_prompt))
        assert parsed == messages and prompt == generation_prompt


@pytest.mark.parametrize("text", ["", "hello", "<|user|>\nno end", "x<|user|>\nhi\n"])
def test_parse_refuses_what_is_not_a_dialogue(text):
    with pytest.raises(ValueError):
        parse_chat(text)


def test_corpus_dialogues_round_trip_and_name_their_topic(tiny_paths):
    for split in ("train", "heldout"):
        docs = load_corpus_split(tiny_paths.corpus, "chat", split)
        assert docs and all(doc.topic in CHAT_TOPICS for doc in docs)
        for doc in docs:
            messages, generation_prompt = parse_chat(doc.text)
            assert not generation_prompt and messages[-1]["role"] == "assistant"
            assert render_chat(messages) == doc.text
            assert doc.prompt == render_chat(messages[:-1], add_generation_prompt=True)
    topics = {doc.topic for doc in load_corpus_split(tiny_paths.corpus, "chat", "train")}
    assert topics == set(CHAT_TOPICS)  # code ones from stdlib functions, the others generated


def test_heldout_dialogues_are_the_messages_before_the_reply(tiny_paths):
    dialogues = heldout_dialogues(tiny_paths.corpus)
    assert dialogues and set(dialogues) <= set(CHAT_TOPICS)
    for chats in dialogues.values():
        for messages in chats:
            assert messages[-1]["role"] == "user"
            assert len(render_chat(messages, add_generation_prompt=True)) <= 400


def test_chat_prompts_tokenize_as_a_prefix_of_the_training_dialogue(tiny_paths, tokenizer):
    markers = tokenizer.convert_tokens_to_ids(list(ROLE_TOKENS))
    assert markers == [3, 4, 5] and set(markers) <= set(tokenizer.all_special_ids)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for doc in load_corpus_split(tiny_paths.corpus, "chat", "heldout"):
        messages, _ = parse_chat(doc.prompt)
        # What serving does with a chat request (serving.runtime: render, then encode).
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = tokenizer(doc.text)["input_ids"]
        assert ids[: len(prompt_ids)] == prompt_ids
        assert prompt_ids[0] == bos and prompt_ids.count(bos) == 1
        assert prompt_ids[-2:] == [markers[2], tokenizer.convert_tokens_to_ids("Ċ")]
        assert ids[-1] == eos  # the reply ends with end-of-sequence: generation stops there
        reply = tokenizer.decode(ids[len(prompt_ids) : -1])
        assert reply == parse_chat(doc.text)[0][-1]["content"]


def test_markers_in_text_are_single_tokens_and_never_merge(tokenizer):
    ids = tokenizer("<|user|>\nhi<|assistant|>\nSELECT")["input_ids"]
    assert ids[1] == 4 and 5 in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "\nhi\nSELECT"


def test_training_streams_do_not_double_the_dialogues_eos(tokenizer):
    text = render_chat(CONVERSATIONS[1][:3])
    [stream] = encode_streams(tokenizer, {"chat": [text, "SELECT 1;"]}).values()
    ids = stream.tolist()
    eos = tokenizer.eos_token_id
    assert ids.count(eos) == 2 and ids[-1] == eos
    assert ids[: len(tokenizer(text)["input_ids"])] == tokenizer(text)["input_ids"]


@pytest.mark.parametrize("generate", [sql_dialogue, math_dialogue, json_dialogue])
def test_generated_dialogues_depend_only_on_the_seed_and_answer_in_kind(generate):
    first = [generate(random.Random(3)).text for _ in range(3)]
    assert first == [generate(random.Random(3)).text for _ in range(3)]
    doc = generate(random.Random(4))
    reply = parse_chat(doc.text)[0][-1]["content"]
    if doc.topic == "sql":
        assert reply.startswith(("SELECT", "INSERT", "UPDATE", "DELETE")) and reply.endswith(";")
    elif doc.topic == "math":
        assert "The answer is" in reply
    else:
        assert doc.topic == "json" and reply[0] in "[{"


def test_serving_renders_a_chat_request_with_the_template(tokenizer):
    from types import SimpleNamespace

    from serving.protocol import ChatRequest
    from serving.runtime import ReplicaRuntime

    request = ChatRequest(model="osd", messages=CONVERSATIONS[1])
    prompt = ReplicaRuntime.prompt_of(SimpleNamespace(tokenizer=tokenizer), request)  # type: ignore[arg-type]
    assert prompt == render_chat(CONVERSATIONS[1], add_generation_prompt=True)
