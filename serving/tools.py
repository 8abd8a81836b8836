"""Tool calling on ``/v1/chat/completions``: OpenAI's request fields, checked, and what a request
asks of the replica (:class:`ToolPlan`).

* ``tools``: function tools (``{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}``), rendered into the prompt by the model's chat template (``tools=``
  as transformers takes them).
* ``tool_choice``: ``"auto"`` (the default with tools: the model decides; its reply is parsed),
  ``"none"`` (no tools: they are left out of the prompt, and nothing is parsed), ``"required"``
  (at least one call) or ``{"type": "function", "function": {"name": ...}}`` (that function);
  the last two are enforced by a grammar (:mod:`serving.tool_parsers`), so the reply is calls
  whose arguments follow the tools' schemas.
* ``parallel_tool_calls``: false allows one call (the grammar makes one; parsing keeps the
  first).
* In the history, an assistant's ``tool_calls`` (their ``arguments`` JSON text is given to the
  template as an object, as vLLM does) and ``tool`` messages with their ``tool_call_id``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from osd.errors import ParamError

__all__ = [
    "FunctionCall",
    "FunctionTool",
    "MessageToolCall",
    "NamedToolChoice",
    "ToolPlan",
    "plan_tools",
    "template_messages",
]

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (and vLLM's dots)


class FunctionSpec(BaseModel):
    """OpenAI's ``tools[].function``."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # osd enforces the schema with required/named tool_choice

    @field_validator("name")
    @classmethod
    def _a_name(cls, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError("must be 1-64 letters, digits, underscores, dots or dashes")
        return name

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        # Arguments are a JSON object (OpenAI refuses another type; a call whose arguments
        # were an array would never parse as one). A schema without a type is an object's.
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of type object (the call's arguments)")
        return parameters


class FunctionTool(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class _NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: _NamedFunction


class FunctionCall(BaseModel):
    """An earlier call's function in an assistant message of the history."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str | dict[str, Any]


class MessageToolCall(BaseModel):
    """One of an assistant message's ``tool_calls`` in the history."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool fields ask of the replica (a request with a plan has its reply
    read for tool calls).

    Attributes:
        tools: the tools for the chat template (OpenAI's objects).
        forced: the functions a grammar makes the reply call (``required``: all offered;
            a named choice: that one); empty: no grammar.
        parallel: more than one call allowed.
        named: ``tool_choice`` named the function (its reply then ends with ``stop``, as
            OpenAI's and vLLM's do, not ``tool_calls``).
    """

    tools: list[dict[str, Any]]
    forced: tuple[dict[str, Any], ...]
    parallel: bool
    named: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        """The offered functions' names."""
        return tuple(tool["function"]["name"] for tool in self.tools)

    @property
    def schemas(self) -> dict[str, Any]:
        """The offered functions' parameters' schemas, by name."""
        return {tool["function"]["name"]: tool["function"].get("parameters") for tool in self.tools}


def plan_tools(
    tools: list[FunctionTool] | None, choice: ToolChoice | None, parallel: bool | None
) -> ToolPlan | None:
    """The plan of a validated chat request; None: no tools (or ``tool_choice`` "none").

    Raises:
        ParamError: a choice that needs tools without them, or a named function not offered.
    """
    if not tools:
        if choice in (None, "none", "auto"):
            return None
        raise ParamError("tool_choice", "tool_choice asks for a tool call, but no tools are given")
    offered = [tool.model_dump(exclude_none=True) for tool in tools]
    plan = ToolPlan(offered, (), parallel is not False and not isinstance(choice, NamedToolChoice))
    names = plan.names
    if len(set(names)) != len(names):
        raise ParamError("tools", "two tools have the same function name")
    if choice == "none":
        return None
    functions = tuple(tool["function"] for tool in offered)
    if choice == "required":
        return dataclasses.replace(plan, forced=functions)
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        if wanted not in names:
            raise ParamError(
                "tool_choice", f"tool_choice names {wanted!r}, which is not among the tools"
            )
        return dataclasses.replace(plan, forced=(functions[names.index(wanted)],), named=True)
    return plan


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The chat messages as the template takes them: an assistant's earlier calls with their
    arguments as objects (templates write them with ``tojson``).

    Raises:
        ParamError: arguments that are not a JSON object's text.
    """
    out = []
    for index, message in enumerate(messages):
        item = message.model_dump()  # what the client sent (ChatMessage leaves out the unsent)
        for j, call in enumerate(item.get("tool_calls") or []):
            arguments = call["function"]["arguments"]
            if isinstance(arguments, str):
                call["function"]["arguments"] = _object_of(
                    arguments, f"messages[{index}].tool_calls[{j}].function.arguments"
                )
        out.append(item)
    return out


def _object_of(text: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:  # not JSON, or an integer longer than Python reads
        value = None
    if not isinstance(value, dict):
        raise ParamError(param, "an earlier call's arguments must be a JSON object's text")
    return value
