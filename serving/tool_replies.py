"""A chat choice's reply with tools: its text read for tool calls (:mod:`serving.tool_parsers`)
and answered in OpenAI's shapes, whole or streamed.

Whole: ``message: {"role": "assistant", "content": <text outside the calls, or null>,
"tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}]}``. Streamed: the
content as ``delta.content`` and each call, once its JSON is complete, as one ``delta.tool_calls``
entry with its ``index`` among the choice's calls, its id, name and whole arguments (OpenAI's
clients accumulate either form). A reply that called a tool and stopped by itself ends with
``finish_reason: "tool_calls"`` (``stop`` where ``tool_choice`` named the function, as OpenAI's
and vLLM's); one cut by ``max_tokens`` keeps ``length``, its unfinished call
as content.
"""

from __future__ import annotations

from typing import Any

from serving.tool_parsers import ParsedCall, ToolCallFormat, ToolCallScanner
from serving.tools import ToolPlan

__all__ = ["ToolReply"]


class ToolReply:
    """One choice's reply, read for tool calls as its text arrives.

    Args:
        form: the replica's tool-call format (:func:`serving.tool_parsers.tool_call_format`).
        plan: the request's tools.
    """

    def __init__(self, form: ToolCallFormat, plan: ToolPlan) -> None:
        self._scanner = ToolCallScanner(form.name, plan.names, plan.parallel, plan.schemas)
        self._format = form
        self._count = 0
        self._named = plan.named

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The next text: (content to send, ``delta.tool_calls`` entries)."""
        content, calls = self._scanner.feed(text)
        return content, self._deltas(calls)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The reply ended: what was held back."""
        content, calls = self._scanner.finish()
        return content, self._deltas(calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` for a reply that called and stopped by itself (``stop`` where the
        request named the function, as OpenAI answers)."""
        called = reason == "stop" and self._scanner.called and not self._named
        return "tool_calls" if called else reason

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole reply: (OpenAI's message, finish reason)."""
        head, first = self.feed(text)
        tail, last = self.finish()
        calls = [_without_index(call) for call in first + last]
        if not calls:
            return {"role": "assistant", "content": head + tail}, reason
        message = {"role": "assistant", "content": head + tail or None, "tool_calls": calls}
        return message, self.finish_reason(reason)

    def _deltas(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        deltas = []
        for call in calls:
            deltas.append(
                {
                    "index": self._count,
                    "id": self._format.new_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
            self._count += 1
        return deltas


def _without_index(delta: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in delta.items() if key != "index"}
