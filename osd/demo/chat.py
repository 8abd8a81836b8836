"""The demo's chat format: a Jinja chat template, the same rendering in Python, and its inverse.

A dialogue renders as::

    <|system|>\\n{content}\\n          (optional; OpenAI's "developer" role renders as system)
    <|user|>\\n{content}\\n
    <|assistant|>\\n{content}<|endoftext|>
    ...

and a prompt for the next reply ends with ``<|assistant|>\\n`` (``add_generation_prompt``). The
role markers are special tokens of the demo tokenizer (ids 3, 4, 5): one token each, never split
or merged with the text around them, so a rendered prompt tokenizes exactly as the same prefix of
a training dialogue, and a user's text can never be mistaken for a marker by the BPE merges. The
assistant's turn ends with the end-of-sequence token, so generation stops when the reply is done.
No ``<|bos|>`` in the template: the tokenizer prepends it to every encoded text already.

Tools (``tools=`` as transformers passes them, OpenAI's ``{"type": "function", "function":
{...}}`` objects) render in the Hermes / Qwen format that ``serving.tool_parsers``' ``hermes``
parser reads, JSON compact as the tool-call grammar generates it::

    <|system|>\\n{system content}\\n<tools>\\n{function JSON}\\n...</tools>\\n
    <|assistant|>\\n{content}<tool_call>\\n{"name":...,"arguments":{...}}\\n</tool_call><|endoftext|>
    <|user|>\\n<tool_response>\\n{tool message content}\\n</tool_response>\\n

(calls after content or after another call start on a new line; a ``tool`` message renders as a
user turn holding the response, as Qwen's template does).

The corpus is rendered by :func:`render_chat` (the corpus is built before the tokenizer exists);
the tokenizer carries :data:`CHAT_TEMPLATE`, and the tests check both render the same text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from osd.demo.recipe import ASSISTANT_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN

__all__ = ["CHAT_ROLES", "CHAT_TEMPLATE", "parse_chat", "render_chat", "tool_call_text"]

CHAT_ROLES = ("system", "user", "assistant", "tool")
_MARKERS = {"system": SYSTEM_TOKEN, "user": USER_TOKEN, "assistant": ASSISTANT_TOKEN}
_ALIASES = {"developer": "system"}

# Whitespace-exact: every tag trims its surroundings, the only newlines are inside strings.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(start=0) -%}"
    "{%- if tools -%}"
    "{{- '<|system|>\n' -}}"
    "{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- messages[0]['content'] + '\n' -}}{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{{- '<tools>\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set function = tool['function'] if tool['function'] is defined else tool -%}"
    "{{- function | tojson(separators=(',', ':')) + '\n' -}}"
    "{%- endfor -%}"
    "{{- '</tools>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{%- set role = 'system' if message['role'] == 'developer' else message['role'] -%}"
    "{%- if role not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('the demo chat template knows the roles system, user, assistant and "
    "tool, not ' + role) -}}"
    "{%- endif -%}"
    "{%- if role == 'tool' -%}"
    "{{- '<|user|>\n<tool_response>\n' + message['content'] + '\n</tool_response>\n' -}}"
    "{%- else -%}"
    "{{- '<|' + role + '|>\n' + (message['content'] or '') -}}"
    "{%- if role == 'assistant' -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\n' -}}{%- endif -%}"
    "{{- '<tool_call>\n{\"name\":' + call['name'] | tojson + ',\"arguments\":' -}}"
    "{%- if call['arguments'] is string -%}{{- call['arguments'] -}}"
    "{%- else -%}{{- call['arguments'] | tojson(separators=(',', ':')) -}}{%- endif -%}"
    "{{- '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- else -%}{{- '\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)


def _role(message: Mapping[str, Any]) -> str:
    role = _ALIASES.get(message["role"], message["role"])
    if role not in CHAT_ROLES:
        raise ValueError(f"the demo chat template knows the roles {CHAT_ROLES}, not {role!r}")
    return str(role)


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def tool_call_text(name: str, arguments: Any) -> str:
    """One call as the template renders it (``arguments``: a dict, or its JSON text)."""
    args = arguments if isinstance(arguments, str) else _compact(arguments)
    head = json.dumps(name, ensure_ascii=False)
    return f'<tool_call>\n{{"name":{head},"arguments":{args}}}\n</tool_call>'


def _assistant_body(message: Mapping[str, Any]) -> str:
    body = message.get("content") or ""
    for index, tool_call in enumerate(message.get("tool_calls") or []):
        call = tool_call.get("function", tool_call)
        if body or index:
            body += "\n"
        body += tool_call_text(call["name"], call["arguments"])
    return body


def _tools_turn(tools: Sequence[Mapping[str, Any]], system: str | None) -> str:
    lines = [_compact(tool.get("function", tool)) for tool in tools]
    head = f"{system}\n" if system is not None else ""
    return (
        f"{SYSTEM_TOKEN}\n{head}<tools>\n" + "".join(f"{line}\n" for line in lines) + "</tools>\n"
    )


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """What ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, ...)``
    renders.

    Raises:
        ValueError: on a role other than system, developer, user, assistant or tool.
    """
    parts = []
    if tools:
        system = None
        if messages and messages[0]["role"] in ("system", "developer"):
            system, messages = messages[0]["content"], messages[1:]
        parts.append(_tools_turn(tools, system))
    for message in messages:
        role = _role(message)
        if role == "tool":
            parts.append(f"{USER_TOKEN}\n<tool_response>\n{message['content']}\n</tool_response>\n")
        elif role == "assistant":
            parts.append(f"{ASSISTANT_TOKEN}\n{_assistant_body(message)}{EOS_TOKEN}")
        else:
            parts.append(f"{_MARKERS[role]}\n{message['content']}\n")
    if add_generation_prompt:
        parts.append(f"{ASSISTANT_TOKEN}\n")
    return "".join(parts)


_TURN = re.compile("(" + "|".join(re.escape(m) for m in _MARKERS.values()) + ")\n")
_ROLE_OF = {marker: role for role, marker in _MARKERS.items()}


def parse_chat(text: str) -> tuple[list[dict[str, str]], bool]:
    """The messages a rendered dialogue holds, and whether it ends with a generation prompt.

    The inverse of :func:`render_chat` for dialogues without tools whose contents hold no role
    marker.

    Raises:
        ValueError: if the text is not a rendered dialogue.
    """
    pieces = _TURN.split(text)
    if pieces[0] or len(pieces) < 3:
        raise ValueError(f"not a rendered dialogue: {text[:80]!r}")
    messages: list[dict[str, str]] = []
    generation_prompt = False
    turns = list(zip(pieces[1::2], pieces[2::2], strict=True))
    for index, (marker, body) in enumerate(turns):
        role = _ROLE_OF[marker]
        end = EOS_TOKEN if role == "assistant" else "\n"
        if role == "assistant" and not body and index == len(turns) - 1:
            generation_prompt = True
            break
        if not body.endswith(end):
            raise ValueError(f"a {role} turn must end with {end!r}: {body[-80:]!r}")
        messages.append({"role": role, "content": body[: -len(end)]})
    return messages, generation_prompt
