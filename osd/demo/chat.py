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

The corpus is rendered by :func:`render_chat` (the corpus is built before the tokenizer exists);
the tokenizer carries :data:`CHAT_TEMPLATE`, and the tests check both render the same text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from osd.demo.recipe import ASSISTANT_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN

__all__ = ["CHAT_ROLES", "CHAT_TEMPLATE", "parse_chat", "render_chat"]

CHAT_ROLES = ("system", "user", "assistant")
_MARKERS = {"system": SYSTEM_TOKEN, "user": USER_TOKEN, "assistant": ASSISTANT_TOKEN}
_ALIASES = {"developer": "system"}

# Whitespace-exact: every tag trims its surroundings, the only newlines are inside strings.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set role = 'system' if message['role'] == 'developer' else message['role'] -%}"
    "{%- if role not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('the demo chat template knows the roles system, user and assistant, "
    "not ' + role) -}}"
    "{%- endif -%}"
    "{{- '<|' + role + '|>\n' + message['content'] -}}"
    "{%- if role == 'assistant' -%}{{- eos_token -}}{%- else -%}{{- '\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
)


def _role(message: Mapping[str, str]) -> str:
    role = _ALIASES.get(message["role"], message["role"])
    if role not in _MARKERS:
        raise ValueError(f"the demo chat template knows the roles {CHAT_ROLES}, not {role!r}")
    return role


def render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """What ``tokenizer.apply_chat_template(messages, tokenize=False, ...)`` renders.

    Raises:
        ValueError: on a role other than system, developer, user or assistant.
    """
    parts = []
    for message in messages:
        role = _role(message)
        end = EOS_TOKEN if role == "assistant" else "\n"
        parts.append(f"{_MARKERS[role]}\n{message['content']}{end}")
    if add_generation_prompt:
        parts.append(f"{ASSISTANT_TOKEN}\n")
    return "".join(parts)


_TURN = re.compile("(" + "|".join(re.escape(m) for m in _MARKERS.values()) + ")\n")
_ROLE_OF = {marker: role for role, marker in _MARKERS.items()}


def parse_chat(text: str) -> tuple[list[dict[str, str]], bool]:
    """The messages a rendered dialogue holds, and whether it ends with a generation prompt.

    The inverse of :func:`render_chat` for dialogues whose contents hold no role marker.

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
