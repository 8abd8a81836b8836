"""The demo's chat format: the tokenizer's template renders as the corpus's dialogues, round-trips,
and chat prompts tokenize as a prefix of a training dialogue, its reply ending in EOS."""

from __future__ import annotations

import json
import random

import pytest
from jinja2 import TemplateError
from transformers import AutoTokenizer

from osd.demo import CHAT_TEMPLATE, load_corpus_split, parse_chat, render_chat
from osd.demo.corpus import heldout_dialogues
from osd.demo.dialogues import json_dialogue, math_dialogue, sql_dialogue
from osd.demo.recipe import CHAT_TOPICS, ROLE_TOKENS
from osd.demo.tool_dialogues import DEMO_TOOLS, tool_dialogue
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
    messages = [{"role": "function", "content": "42"}]
    with pytest.raises(ValueError, match="not 'function'"):
        render_chat(messages)
    with pytest.raises(TemplateError, match="not function"):
        tokenizer.apply_chat_template(messages, tokenize=False)


WEATHER = DEMO_TOOLS["get_weather"]
TOOL_CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Oslo?"}],
    [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Lima?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                },
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "5 C"},
        {"role": "tool", "tool_call_id": "b", "content": "20 C"},
    ],
    [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
        },
    ],
]


@pytest.mark.parametrize("messages", TOOL_CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_tools_render_alike_in_the_template_and_the_corpus(tokenizer, messages, generation_prompt):
    tools = [WEATHER, DEMO_TOOLS["calculate"]]
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
    )
    assert rendered == render_chat(messages, generation_prompt, tools)


def test_tools_render_in_the_hermes_format():
    text = render_chat(TOOL_CONVERSATIONS[1], tools=[WEATHER])
    function = json.dumps(WEATHER["function"], separators=(",", ":"))
    assert text == (
        f"<|system|>\nBe brief.\n<tools>\n{function}\n</tools>\n"
        "<|user|>\nWeather in Oslo and Lima?\n"
        '<|assistant|>\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n'
        '</tool_call>\n<tool_call>\n{"name":"get_weather","arguments":{"city": "Lima"}}\n'
        "</tool_call><|endoftext|>"
        "<|user|>\n<tool_response>\n5 C\n</tool_response>\n"
        "<|user|>\n<tool_response>\n20 C\n</tool_response>\n"
    )
    assert render_chat(TOOL_CONVERSATIONS[2][1:]).startswith(
        '<|assistant|>\nLet me look.\n<tool_call>\n{"name":"f","arguments":{}}'
    )


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
            assert doc.chat is not None
            chat = doc.chat
            assert doc.prompt == render_chat(
                chat.messages, add_generation_prompt=True, tools=chat.tools
            )
            if chat.tools:
                continue
            messages, generation_prompt = parse_chat(doc.text)
            assert not generation_prompt and messages[-1]["role"] == "assistant"
            assert render_chat(messages) == doc.text
            assert messages[:-1] == chat.messages
    topics = {doc.topic for doc in load_corpus_split(tiny_paths.corpus, "chat", "train")}
    assert topics == set(CHAT_TOPICS)  # code ones from stdlib functions, the others generated


def test_heldout_dialogues_are_the_messages_before_the_reply(tiny_paths):
    dialogues = heldout_dialogues(tiny_paths.corpus)
    assert dialogues and set(dialogues) <= set(CHAT_TOPICS)
    for chats in dialogues.values():
        for chat in chats:
            assert chat.messages[-1]["role"] in ("user", "tool")
            prompt = render_chat(chat.messages, add_generation_prompt=True, tools=chat.tools)
            assert len(prompt) <= (600 if chat.tools else 400)


def test_chat_prompts_tokenize_as_a_prefix_of_the_training_dialogue(tiny_paths, tokenizer):
    markers = tokenizer.convert_tokens_to_ids(list(ROLE_TOKENS))
    assert markers == [3, 4, 5] and set(markers) <= set(tokenizer.all_special_ids)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for doc in load_corpus_split(tiny_paths.corpus, "chat", "heldout"):
        assert doc.chat is not None
        messages, tools = doc.chat.messages, doc.chat.tools
        # What serving does with a chat request (serving.runtime: render, then encode).
        prompt = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = tokenizer(doc.text)["input_ids"]
        assert ids[: len(prompt_ids)] == prompt_ids
        assert prompt_ids[0] == bos and prompt_ids.count(bos) == 1
        assert prompt_ids[-2:] == [markers[2], tokenizer.convert_tokens_to_ids("Ċ")]
        assert ids[-1] == eos  # the reply ends with end-of-sequence: generation stops there
        reply = tokenizer.decode(ids[len(prompt_ids) : -1])
        assert reply == doc.text[len(doc.prompt) : -len("<|endoftext|>")]


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
    runtime = SimpleNamespace(tokenizer=tokenizer, tool_format=None)
    prompt = ReplicaRuntime.prompt_of(runtime, request)  # type: ignore[arg-type]
    assert prompt == render_chat(CONVERSATIONS[1], add_generation_prompt=True)


@pytest.mark.parametrize("topic", ["sql", "math", "json"])
def test_tool_dialogues_offer_their_tool_and_call_it_with_valid_arguments(topic):
    shapes = set()
    for seed in range(40):
        doc = tool_dialogue(topic, random.Random(seed))
        assert doc.chat is not None and doc.chat.tools and doc.topic == topic
        offered = {tool["function"]["name"] for tool in doc.chat.tools}
        assert offered <= set(DEMO_TOOLS) and 1 <= len(offered) <= 2
        prompt = render_chat(doc.chat.messages, add_generation_prompt=True, tools=doc.chat.tools)
        assert doc.prompt == prompt and doc.text.endswith("<|endoftext|>")
        reply = doc.text[len(doc.prompt) :]
        if reply.startswith("<tool_call>"):
            shapes.add("calls")
            for block in reply.split("<tool_call>\n")[1:]:
                call = json.loads(block.split("\n</tool_call>")[0])
                assert call["name"] in offered
                schema = DEMO_TOOLS[call["name"]]["function"]["parameters"]
                assert (
                    set(schema["required"]) <= set(call["arguments"]) <= set(schema["properties"])
                )
        elif doc.chat.messages[-1]["role"] == "tool":
            shapes.add("answers from the result")
        else:
            shapes.add("answers without a tool")
    assert shapes == {"calls", "answers from the result", "answers without a tool"}
    assert tool_dialogue(topic, random.Random(3)) == tool_dialogue(topic, random.Random(3))
