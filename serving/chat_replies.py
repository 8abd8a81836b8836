"""A chat choice's reply read for thinking (:mod:`serving.reasoning`) and tool calls
(:mod:`serving.tool_parsers`) and answered in OpenAI's shapes, whole or streamed.

Whole: ``message: {"role": "assistant", "content": <text outside the thinking and the calls, or
null>, "reasoning": <the thinking, or null>, "reasoning_content": <the same>, "tool_calls":
[{"id", "type": "function", "function": {"name", "arguments"}}]}`` (the reasoning fields where
the replica reads thinking, the calls where the reply made some). Streamed: the thinking as
``delta.reasoning`` (and ``delta.reasoning_content``), the content as ``delta.content`` and each
call, once it is complete, as one ``delta.tool_calls`` entry with its ``index`` among the
choice's calls, its id, name and whole arguments (OpenAI's clients accumulate either form). A
reply that called a tool and stopped by itself ends with ``finish_reason: "tool_calls"``
(``stop`` where ``tool_choice`` named the function, as OpenAI's and vLLM's); one cut by
``max_tokens`` keeps ``length``, its unfinished call as content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from serving.harmony import END as HARMONY_END
from serving.harmony import HarmonyReader
from serving.reasoning import ReasoningReader
from serving.tool_parsers import ParsedCall, ToolCallFormat, ToolCallScanner
from serving.tools import ToolPlan

__all__ = ["ChatReply", "Piece"]


@dataclass
class Piece:
    """What one piece of a reply sends: thinking, content and completed calls (as
    ``delta.tool_calls`` entries)."""

    thinking: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __add__(self, other: Piece) -> Piece:
        return Piece(
            self.thinking + other.thinking, self.content + other.content, self.calls + other.calls
        )

    def delta(self) -> dict[str, Any]:
        """The piece's fields of a streamed ``delta`` (content only where it has some, or
        where nothing else is sent)."""
        delta: dict[str, Any] = {}
        if self.thinking:
            delta["reasoning"] = delta["reasoning_content"] = self.thinking
        if self.content or not (self.calls or self.thinking):
            delta["content"] = self.content
        if self.calls:
            delta["tool_calls"] = self.calls
        return delta


class ChatReply:
    """One choice's reply, read as its text arrives.

    Args:
        reasoning: reads the thinking apart (None: the replica reads none).
        form: the replica's tool-call format, with ``plan`` the request's tools (None: no
            tools: the reply is not read for calls).
        plan: the request's tools.
        include_reasoning: false leaves the thinking out of the answer (vLLM's field).
        harmony: the reply is gpt-oss's harmony messages, read for thinking and calls alike
            (``reasoning`` unused).
    """

    def __init__(
        self,
        reasoning: ReasoningReader | None,
        form: ToolCallFormat | None = None,
        plan: ToolPlan | None = None,
        include_reasoning: bool = True,
        harmony: bool = False,
    ) -> None:
        tools = None if form is None else plan
        self._reasoning = reasoning
        self._include = include_reasoning
        self._form = form
        self._harmony = (
            None
            if not harmony
            else HarmonyReader(
                None if tools is None else tools.names, tools is None or tools.parallel
            )
        )
        self._scanner = (
            None
            if tools is None or form is None or harmony
            else ToolCallScanner(form.name, tools.names, tools.parallel, tools.schemas)
        )
        self._named = tools is not None and tools.named
        # The markers that end a call, a section of calls, the thinking or a harmony message
        # (feed_ordered), and the reply's last characters, where one may have begun.
        self._markers = [] if self._scanner is None else list(self._scanner.closes)
        if harmony:
            self._markers = [HARMONY_END]
        elif reasoning is not None:
            self._markers.append(reasoning.closing)
        self._longest = max((len(m) - 1 for m in self._markers), default=0)
        self._recent = ""
        self._count = 0
        self._ids: set[str | None] = {None}  # the model's own call ids given out

    def feed(self, text: str) -> Piece:
        """The next text of the reply: what it sends."""
        if self._harmony is not None:
            return self._harmony_piece(*self._harmony.feed(text))
        thinking, answer = ("", text) if self._reasoning is None else self._reasoning.feed(text)
        return self._read(thinking, answer, final=False)

    def finish(self, reason: str | None = "stop") -> Piece:
        """The reply ended (``reason``: its finish reason): what was held back."""
        if self._harmony is not None:
            return self._harmony_piece(*self._harmony.finish())
        thinking, answer = ("", "") if self._reasoning is None else self._reasoning.finish()
        return self._read(thinking, answer, final=True, cut=reason == "length")

    def ordered(self, text: str, reason: str | None) -> list[Piece]:
        """A whole reply's pieces in the order it said them: :meth:`feed_ordered`, then the
        end."""
        return [*self.feed_ordered(text), self.finish(reason)]

    def feed_ordered(self, text: str) -> list[Piece]:
        """The next text of the reply as pieces in the order it said them: read in stretches
        that each end at a closing marker (a call's, a section's, the thinking's, a harmony
        message's), so a piece's text comes before its call, and text after a call is a piece
        of its own. (:meth:`feed` gives one piece, whose text and calls' order is lost.)"""
        if not self._markers:
            return [self.feed(text)]
        recent = self._recent + text
        cut = len(self._recent)
        ends = sorted(
            {
                found.end() - cut
                for marker in self._markers
                for found in re.finditer(re.escape(marker), recent)
                if found.end() > cut
            }
        )
        self._recent = recent[-self._longest :] if self._longest else ""
        starts = [0, *ends]
        stretches = [text[a:b] for a, b in zip(starts, [*ends, len(text)], strict=True) if b > a]
        return [self.feed(stretch) for stretch in stretches] or [self.feed("")]

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` for a reply that called and stopped by itself (``stop`` where the
        request named the function, as OpenAI answers)."""
        called = (self._scanner is not None and self._scanner.called) or bool(
            self._harmony is not None and self._harmony.calls
        )
        return "tool_calls" if reason == "stop" and called and not self._named else reason

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole reply: (OpenAI's message, finish reason)."""
        whole = self.feed(text) + self.finish(reason)
        message: dict[str, Any] = {"role": "assistant", "content": whole.content}
        if self._reasoning is not None or self._harmony is not None:
            thought = whole.thinking or None
            message["reasoning"] = message["reasoning_content"] = thought
            if thought and not whole.content:  # only thought (cut short): no answer, as vLLM
                message["content"] = None
        if not whole.calls:
            return message, reason
        message["content"] = whole.content or None
        message["tool_calls"] = [_without_index(call) for call in whole.calls]
        return message, self.finish_reason(reason)

    def _harmony_piece(self, thinking: str, content: str, calls: list[ParsedCall]) -> Piece:
        return Piece(thinking if self._include else "", content, self._deltas(calls))

    def _read(self, thinking: str, answer: str, final: bool, cut: bool = False) -> Piece:
        if not self._include:
            thinking = ""
        if self._scanner is None:
            return Piece(thinking, answer)
        content, calls = self._scanner.feed(answer)
        if final:
            tail, last = self._scanner.finish(cut)
            content, calls = content + tail, calls + last
        return Piece(thinking, content, self._deltas(calls))

    def _deltas(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        if not calls:
            return []
        assert self._form is not None  # calls are read only where the replica has a format
        deltas = []
        for call in calls:
            # The model's own id (Kimi K2's), unless it wrote one twice in this reply.
            call_id = call.call_id if call.call_id not in self._ids else None
            self._ids.add(call_id)
            deltas.append(
                {
                    "index": self._count,
                    "id": call_id or self._form.new_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
            self._count += 1
        return deltas


def _without_index(delta: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in delta.items() if key != "index"}
