"""Tool-using dialogues for the demo corpus's chat domain, so the demo pair learns to call tools
in the Hermes format of its chat template (:mod:`osd.demo.chat`) and serving's ``hermes`` tool
parser has something to parse.

A dialogue offers the relevant tool, alone or beside one other (in a random order), then either

* **calls**: the user asks for something a tool does; the reply is the call (two calls when
  the user asks the weather of two cities: parallel tool calls);
* **answers from the result**: the call, the tool's response, and a reply in words from it;
* **answers without a tool**: the user asks for something none of the tools does (write a
  query, rather than run it); the reply is the plain answer.

The tools are small, so the prompts fit the demo models' 256 positions: ``run_sql`` (SQL
topic), ``calculate`` (math), ``get_weather`` and ``save_config`` (JSON: their arguments are
JSON objects with strings, integers and an enum).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from osd.demo.dialogues import Message, dialogue_document
from osd.demo.synthetic import CITIES, SCHEMAS, WORDS, Document, _math_problem, _query

__all__ = ["DEMO_TOOLS", "tool_dialogue"]


def _function(
    name: str, description: str, properties: dict[str, Any], required: list[str]
) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


_STRING = {"type": "string"}
_INTEGER = {"type": "integer"}
DEMO_TOOLS: dict[str, dict[str, Any]] = {
    "run_sql": _function(
        "run_sql", "Run a SQL query", {"database": _STRING, "query": _STRING}, ["database", "query"]
    ),
    "calculate": _function(
        "calculate", "Evaluate arithmetic", {"expression": _STRING}, ["expression"]
    ),
    "get_weather": _function(
        "get_weather",
        "Current weather of a city",
        {"city": _STRING, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    "save_config": _function(
        "save_config",
        "Save a service config",
        {"service": _STRING, "port": _INTEGER, "replicas": _INTEGER},
        ["service", "port", "replicas"],
    ),
}
_CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowing", "foggy")


def _call(name: str, arguments: dict[str, Any], index: int) -> dict[str, Any]:
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _sql(rng: random.Random) -> tuple[str, list[dict[str, Any]], list[str], str]:
    """(user's ask, calls, the tool responses, the reply from them); the tool's name first."""
    database = rng.choice(sorted(SCHEMAS))
    question, sql = _query(SCHEMAS[database], rng)
    rows = rng.randint(0, 40)
    ask = f"Run a query on the {database} database for the {question}."
    call = _call("run_sql", {"database": database, "query": sql}, 0)
    reply = f"The query returned {rows} row{'s' if rows != 1 else ''}."
    return ask, [call], [f'{{"rows":{rows}}}'], reply


def _calculate(rng: random.Random) -> tuple[str, list[dict[str, Any]], list[str], str]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 40), rng.randint(2, 12)
    op = rng.choice(["+", "-", "*"])
    expression = f"{a} {op} {b} * {c}"
    value = eval(expression, {"__builtins__": {}})  # noqa: S307 - three generated integers
    ask = rng.choice(["Calculate", "Use the calculator:", "Compute"]) + f" {expression}."
    call = _call("calculate", {"expression": expression}, 0)
    return ask, [call], [str(value)], f"The answer is {value}."


def _weather(rng: random.Random) -> tuple[str, list[dict[str, Any]], list[str], str]:
    cities = rng.sample(CITIES, k=2 if rng.random() < 0.3 else 1)
    unit = rng.choice(["celsius", "fahrenheit"]) if rng.random() < 0.4 else None
    calls, responses, replies = [], [], []
    for index, city in enumerate(cities):
        arguments: dict[str, Any] = {"city": city} | ({"unit": unit} if unit else {})
        calls.append(_call("get_weather", arguments, index))
        degrees = rng.randint(-5, 35) if unit != "fahrenheit" else rng.randint(23, 95)
        condition = rng.choice(_CONDITIONS)
        responses.append(f'{{"temperature":{degrees},"condition":"{condition}"}}')
        replies.append(f"{city}: {degrees} degrees, {condition}.")
    in_unit = f" in {unit}" if unit else ""
    ask = f"What is the weather in {' and '.join(cities)}{in_unit}?"
    return ask, calls, responses, " ".join(replies)


def _save_config(rng: random.Random) -> tuple[str, list[dict[str, Any]], list[str], str]:
    service = f"{rng.choice(WORDS)}-{rng.choice(['api', 'worker', 'gateway', 'cache'])}"
    port = rng.choice([80, 443, 8000, 8080, 9000, rng.randint(3000, 9999)])
    replicas = rng.randint(1, 8)
    ask = f"Save the config of the {service} service on port {port} with {replicas} replicas."
    call = _call("save_config", {"service": service, "port": port, "replicas": replicas}, 0)
    return ask, [call], ['{"saved":true}'], f"Saved the {service} config."


_Scenario = Callable[[random.Random], tuple[str, list[dict[str, Any]], list[str], str]]
# topic -> (tool, scenario) pairs
_SCENARIOS: dict[str, list[tuple[str, _Scenario]]] = {
    "sql": [("run_sql", _sql)],
    "math": [("calculate", _calculate)],
    "json": [("get_weather", _weather), ("save_config", _save_config)],
}


def _plain(topic: str, rng: random.Random) -> tuple[str, str]:
    """A request none of the tools does, and its plain answer."""
    if topic == "sql":
        database = rng.choice(sorted(SCHEMAS))
        question, sql = _query(SCHEMAS[database], rng)
        return f"In the {database} database, write a query for the {question}.", sql
    if topic == "math":
        question, steps, answer = _math_problem(rng)
        return question, f"{' '.join(steps)} The answer is {answer}."
    service = f"{rng.choice(WORDS)}-{rng.choice(['api', 'worker', 'gateway', 'cache'])}"
    port, replicas = rng.choice([80, 443, 8000, 8080, 9000]), rng.randint(1, 8)
    ask = f"Write the config of the {service} service on port {port} with {replicas} replicas"
    ask += " as JSON."
    return ask, json.dumps({"service": service, "port": port, "replicas": replicas})


def tool_dialogue(topic: str, rng: random.Random) -> Document:
    """A dialogue on ``topic`` (sql, math or json) offering tools (see the module docstring)."""
    tool, scenario = rng.choice(_SCENARIOS[topic])
    others = rng.sample([t for t in sorted(DEMO_TOOLS) if t != tool], k=rng.randint(0, 1))
    shape = rng.random()
    offered = [tool, *others]
    if shape >= 0.8:  # the plain answer: the tool that would help is not offered (or is unused)
        offered = others or [t for t in sorted(DEMO_TOOLS) if t != tool][:1]
    rng.shuffle(offered)
    tools = [DEMO_TOOLS[name] for name in offered]
    messages: list[Message] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are a helpful assistant."})
    if shape >= 0.8:
        ask, answer = _plain(topic, rng)
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
        return dialogue_document(messages, topic, tools)
    ask, calls, responses, reply = scenario(rng)
    messages += [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]
    if shape >= 0.5:  # answers from the tool's response
        for call, response in zip(calls, responses, strict=True):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": response})
        messages.append({"role": "assistant", "content": reply})
    return dialogue_document(messages, topic, tools)
