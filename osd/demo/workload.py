"""Prompt streams with domain labels: the traffic of the demo, the benchmarks and the tests.

A workload is a JSONL file, one request per line::

    {"prompt": "SELECT", "domain": "sql", "max_tokens": 64}

Required: ``prompt`` (non-empty string) or ``messages`` (a chat: a non-empty list of
``{"role": "system" | "developer" | "user" | "assistant" | "tool", "content": string}``, an
assistant's may hold ``tool_calls`` and a tool's its ``tool_call_id``, sent through
``/v1/chat/completions``), not both; ``domain`` (non-empty string; the route key), and
``max_tokens`` (integer >= 1). Optional: ``temperature`` (>= 0), ``top_p`` (in (0, 1]),
``seed`` (integer), ``adapter`` (string), ``id`` (string), ``phase`` (string: which part of a
schedule the request belongs to), ``metadata`` (an object kept as is) and, for a chat,
``tools`` (OpenAI's list of function tools, sent with ``tool_choice`` "auto"). Other keys are
rejected, so a misspelt option never silently does nothing. Users can replace the demo traffic
with their own file in this format::

    {"messages": [{"role": "user", "content": "What is 2 + 3 * 4?"}], "domain": "math",
     "max_tokens": 48}

The demo schedule shifts topics: e.g. ``prose:200,code:200,sql:200,mixed:200`` is 200 prose
prompts, then 200 code, then 200 SQL, then 200 drawn from all domains at random; prompts are
held-out corpus prompts, never seen in training. With ``chat_share`` a share of the requests of
each domain that has held-out dialogues (code, SQL, math, JSON) are chats on that domain instead;
a ``chat`` phase is all chats, on topics drawn at random.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from osd.demo.synthetic import Chat

__all__ = [
    "CHAT",
    "MIXED",
    "WorkloadItem",
    "load_workload",
    "make_workload",
    "parse_schedule",
    "parse_workload_line",
    "write_workload",
]

MIXED = "mixed"
CHAT = "chat"
_REQUIRED = ("domain", "max_tokens")  # and one of prompt, messages
_OPTIONAL = ("temperature", "top_p", "seed", "adapter", "id", "phase", "metadata", "tools")
_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})


@dataclass(frozen=True)
class WorkloadItem:
    """One request of a workload; see the module docstring for the fields."""

    prompt: str
    domain: str
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    adapter: str | None = None
    id: str | None = None
    phase: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None  # a chat (then ``prompt`` is "")
    tools: list[dict[str, Any]] | None = None  # the tools a chat offers

    @property
    def is_chat(self) -> bool:
        """Sent through ``/v1/chat/completions``."""
        return self.messages is not None

    def to_json(self) -> str:
        """One JSONL line without the unset optional fields."""
        row = {
            k: v
            for k, v in asdict(self).items()
            if k in _REQUIRED or (k == "prompt" and not self.is_chat) or v not in (None, {}, [])
        }
        if self.is_chat:
            row.pop("prompt", None)
        return json.dumps(row, ensure_ascii=False)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_fields(row: Mapping[str, Any]) -> str | None:
    """What is wrong with a parsed line, or None."""
    allowed = ("prompt", "messages", *_REQUIRED, *_OPTIONAL)
    unknown = sorted(set(row) - set(allowed))
    if unknown:
        return f"unknown keys {unknown}; allowed: {list(allowed)}"
    if "prompt" in row and "messages" in row:
        return "give 'prompt' (a completion) or 'messages' (a chat), not both"
    missing = [] if "prompt" in row or "messages" in row else ["prompt or messages"]
    missing += [key for key in _REQUIRED if key not in row]
    if missing:
        return f"missing required keys {missing}"
    for key in ("prompt", "domain"):
        if key in row and (not isinstance(row[key], str) or not row[key]):
            return f"{key!r} must be a non-empty string, got {row[key]!r}"
    if "messages" in row:
        problem = _check_messages(row["messages"])
        if problem:
            return problem
    if "tools" in row:
        if "messages" not in row:
            return "'tools' go with 'messages' (a chat), not with a prompt"
        tools = row["tools"]
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            return f"'tools' must be a list of objects (OpenAI's function tools), got {tools!r}"
    if not _is_int(row["max_tokens"]) or row["max_tokens"] < 1:
        return f"'max_tokens' must be an integer >= 1, got {row['max_tokens']!r}"
    temperature, top_p = row.get("temperature"), row.get("top_p")
    if temperature is not None and (not _is_number(temperature) or temperature < 0):
        return f"'temperature' must be a number >= 0, got {temperature!r}"
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        return f"'top_p' must be a number in (0, 1], got {top_p!r}"
    if row.get("seed") is not None and not _is_int(row["seed"]):
        return f"'seed' must be an integer, got {row['seed']!r}"
    for key in ("adapter", "id", "phase"):
        if row.get(key) is not None and not isinstance(row[key], str):
            return f"{key!r} must be a string, got {row[key]!r}"
    if not isinstance(row.get("metadata", {}), dict):
        return f"'metadata' must be an object, got {row['metadata']!r}"
    return None


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"'messages' must be a non-empty list, got {messages!r}"
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        calls = isinstance(message, dict) and message.get("tool_calls")
        if (
            not isinstance(message, dict)
            or not {"role"} <= set(message) <= _MESSAGE_KEYS
            or message["role"] not in _ROLES
            or not (isinstance(content, str) or (content is None and calls))
        ):
            return (
                f"messages[{i}] must be {{'role': one of {list(_ROLES)}, 'content': a string}} "
                f"(an assistant's may be null beside tool_calls), got {message!r}"
            )
    return None


def parse_workload_line(text: str, line_number: int, source: str = "<workload>") -> WorkloadItem:
    """Parses one JSONL line.

    Raises:
        ValueError: naming ``source:line_number`` and what is wrong.
    """
    where = f"{source}:{line_number}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    problem = _check_fields(row)
    if problem:
        raise ValueError(f"{where}: {problem}")
    number_fields = {k: float(row[k]) for k in ("temperature", "top_p") if row.get(k) is not None}
    return WorkloadItem(**({"prompt": ""} | dict(row) | number_fields))


def load_workload(path: Path | str) -> list[WorkloadItem]:
    """Reads a JSONL workload; blank lines are skipped.

    Raises:
        ValueError: on the first bad line, naming its line number; or if the file is empty.
    """
    items = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if line.strip():
                items.append(parse_workload_line(line, line_number, str(path)))
    if not items:
        raise ValueError(f"{path}: the workload has no requests")
    return items


def write_workload(items: Iterable[WorkloadItem], path: Path | str) -> int:
    """Writes items as JSONL; returns how many."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for item in items:
            f.write(item.to_json() + "\n")
            count += 1
    return count


def parse_schedule(text: str) -> list[tuple[str, int]]:
    """Parses ``"prose:200,code:200,mixed:100"`` into ``[("prose", 200), ...]``.

    Raises:
        ValueError: on a malformed part or a count below 1.
    """
    phases = []
    for part in text.split(","):
        name, sep, count = part.strip().partition(":")
        if not sep or not name or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(
                f"schedule parts must look like 'domain:count' (count >= 1), got {part!r}"
            )
        phases.append((name.strip(), int(count)))
    return phases


class _PromptPool:
    """Hands out a domain's prompts in a seeded order, reshuffling when they run out."""

    def __init__(self, prompts: Sequence[Any], rng: random.Random) -> None:
        self.prompts = list(prompts)
        self.rng = rng
        self.queue: list[Any] = []

    def next(self) -> Any:
        if not self.queue:
            self.queue = list(self.prompts)
            self.rng.shuffle(self.queue)
        return self.queue.pop()


def make_workload(
    prompts: Mapping[str, Sequence[str]],
    schedule: Sequence[tuple[str, int]],
    *,
    max_tokens: int = 64,
    seed: int = 0,
    dialogues: Mapping[str, Sequence[Chat]] | None = None,
    chat_share: float = 0.0,
) -> list[WorkloadItem]:
    """Builds a shifting-topic workload from held-out prompts and dialogues.

    Args:
        prompts: domain -> held-out prompts.
        schedule: (phase, count) pairs in order; a phase is a domain, ``"mixed"`` (each
            request from a domain drawn uniformly at random) or ``"chat"`` (each a chat on a
            topic of ``dialogues`` drawn at random).
        max_tokens: tokens to generate per request.
        seed: seed of the prompt order, the mixed phases' domain draws and the chat draws.
        dialogues: topic (a domain) -> held-out chats (the messages before the reply, the
            tools offered).
        chat_share: in domain and mixed phases, the probability that a request of a domain
            with dialogues is a chat on that domain (its ``domain``, the route key, stays the
            topic's).

    Raises:
        ValueError: if a phase names a domain without prompts, or chats are asked without
            dialogues, or ``chat_share`` is outside [0, 1].
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 0.0 <= chat_share <= 1.0:
        raise ValueError(f"chat_share must be in [0, 1], got {chat_share}")
    domains = sorted(d for d, p in prompts.items() if p)
    topics = sorted(t for t, d in (dialogues or {}).items() if d)
    rng = random.Random(seed)
    chat_rng = random.Random(f"{seed}:chat-share")  # apart: chat_share=0 leaves the rest as is
    pools = {d: _PromptPool(prompts[d], random.Random(f"{seed}:{d}")) for d in domains}
    chats = {
        t: _PromptPool((dialogues or {})[t], random.Random(f"{seed}:chat:{t}")) for t in topics
    }
    items: list[WorkloadItem] = []
    for phase, count in schedule:
        if phase == CHAT and not topics:
            raise ValueError(f"schedule phase {CHAT!r} needs held-out dialogues; none given")
        if phase not in (MIXED, CHAT) and phase not in pools:
            raise ValueError(
                f"schedule phase {phase!r} is not {MIXED!r}, {CHAT!r} or one of {domains}"
            )
        for _ in range(count):
            chat: Chat | None = None
            if phase == CHAT:
                domain = chat_rng.choice(topics)
                chat = chats[domain].next()
            else:
                domain = rng.choice(domains) if phase == MIXED else phase
                if domain in chats and chat_share > 0 and chat_rng.random() < chat_share:
                    chat = chats[domain].next()
            items.append(
                WorkloadItem(
                    prompt="" if chat is not None else pools[domain].next(),
                    domain=domain,
                    max_tokens=max_tokens,
                    id=f"{len(items):06d}",
                    phase=phase,
                    messages=None if chat is None else chat.messages,
                    tools=None if chat is None else chat.tools,
                )
            )
    return items
