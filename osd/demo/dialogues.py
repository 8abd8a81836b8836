"""Chat dialogues for the demo corpus's chat domain: a user asks in words, the assistant answers
with the SQL query, the worked answer or the JSON, rendered with the demo's chat template
(:mod:`osd.demo.chat`).

The questions and answers come from the single-document generators of :mod:`osd.demo.synthetic`;
each dialogue is one :class:`~osd.demo.synthetic.Document` that knows its topic (the domain it is
about, its requests' route key) and whose prompt is every turn before the last reply.
"""

from __future__ import annotations

import json
import random
from typing import Any

from osd.demo.chat import render_chat
from osd.demo.synthetic import (
    SCHEMAS,
    Chat,
    Document,
    _inventory,
    _math_problem,
    _package,
    _query,
    _service,
    _user,
)

__all__ = ["dialogue_document", "json_dialogue", "math_dialogue", "sql_dialogue"]

Message = dict[str, Any]


def dialogue_document(
    messages: list[Message], topic: str, tools: list[dict[str, Any]] | None = None
) -> Document:
    """A dialogue rendered with the chat template (and its tools); the prompt is everything
    before the last assistant reply, up to and including the generation prompt that opens it."""
    if messages[-1]["role"] != "assistant":
        raise ValueError("a corpus dialogue ends with the assistant's reply")
    prompt = render_chat(messages[:-1], add_generation_prompt=True, tools=tools)
    text = render_chat(messages, tools=tools)
    return Document(text, len(prompt), topic, Chat(messages[:-1], tools))


def _turns(rng: random.Random) -> int:
    """How many question/answer turns: mostly one, sometimes two."""
    return 2 if rng.random() < 0.3 else 1


def sql_dialogue(rng: random.Random) -> Document:
    """A user asks for queries over a schema in words; the assistant answers with the SQL."""
    schema_name = rng.choice(sorted(SCHEMAS))
    schema = SCHEMAS[schema_name]
    messages: list[Message] = []
    in_system = rng.random() < 0.5
    if in_system:
        messages.append(
            {"role": "system", "content": f"You write SQL for the {schema_name} database."}
        )
    for turn in range(_turns(rng)):
        question, sql = _query(schema, rng)
        if turn:
            ask = f"Now the {question}."
        elif in_system:
            ask = f"Write a query for the {question}."
        else:
            ask = f"In the {schema_name} database, write a query for the {question}."
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": sql}]
    return dialogue_document(messages, "sql")


def math_dialogue(rng: random.Random) -> Document:
    """A user asks word problems; the assistant answers with the worked answer."""
    messages: list[Message] = []
    for _ in range(_turns(rng)):
        question, steps, answer = _math_problem(rng)
        reply = f"{' '.join(steps)} The answer is {answer}."
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    return dialogue_document(messages, "math")


def _describe(kind: object, value: object) -> str:
    """What a user asking for this JSON value would say."""
    if kind is _service:
        assert isinstance(value, dict)
        return (
            f"Write the JSON config of the {value['service']} service, version "
            f"{value['version']}, with {value['replicas']} replicas on port {value['port']}."
        )
    if kind is _package:
        assert isinstance(value, dict)
        return f"Write a package manifest as JSON for {value['name']} {value['version']}."
    if kind is _user:
        assert isinstance(value, dict)
        user = value["user"]
        assert isinstance(user, dict)
        return f"Give me the user record of {user['name']} from {user['city']} as JSON."
    assert isinstance(value, list)
    return f"List {len(value)} inventory items with sku, price and qty as a JSON array."


def json_dialogue(rng: random.Random) -> Document:
    """A user asks for a config, manifest or record; the assistant answers with the JSON."""
    kind = rng.choice([_service, _package, _user, _inventory])
    value = kind(rng)
    messages: list[Message] = [
        {"role": "user", "content": _describe(kind, value)},
        {"role": "assistant", "content": json.dumps(value, indent=2)},
    ]
    return dialogue_document(messages, "json")
