"""gpt-oss's replies in OpenAI's harmony format, read as OpenAI's message: the ``analysis``
channel is the thinking (``reasoning``), the ``final`` channel and preambles (``commentary``
without a recipient) the content, and a ``commentary`` message to ``functions.name`` a tool
call whose body is its arguments' JSON.

A reply, after the prompt's ``<|start|>assistant``, is messages such as
``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...``;
one that calls a tool writes ``<|channel|>commentary to=functions.get_weather
<|constrain|>json<|message|>{...}`` (the recipient may come before the channel) and ends with
``<|call|>``, an end-of-sequence token of gpt-oss's generation config, as ``<|return|>`` is after
a final answer. The markers are special tokens: a replica that speaks harmony keeps them in a
chat reply's text (``skip_special_tokens`` off) and reads them here; the client never sees them.

:class:`HarmonyReader` reads a reply as it streams, holding back only what may be the start of
a marker, and a call until its body is complete; fed whole it gives the same answer. A reply
that does not begin as harmony (``<|channel|>``, ``<|start|>`` or a recipient) is all content.
Structured output on such a replica is the final channel's message, after an optional
analysis (``osd.decode.grammar``'s ``thinking_first``, as vLLM applies a grammar to it).
"""

from __future__ import annotations

import re
from collections.abc import Collection

from serving.tool_parsers import ParsedCall, call_of_arguments, held_back, speaks_harmony

__all__ = ["HARMONY_MARKERS", "HarmonyReader", "speaks_harmony"]  # (speaks_harmony: tool_parsers')

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
HARMONY_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# What ends a message's body: its end, a call's or a reply's end, or (tolerated) a new message's
# header, without the end before it.
_BODY_ENDS = (END, CALL, RETURN, START, CHANNEL)
_BEGINNINGS = (START, CHANNEL, "to=")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_MARKERS = re.compile("|".join(re.escape(m) for m in HARMONY_MARKERS))


class HarmonyReader:
    """One reply's thinking, content and tool calls, as its text arrives.

    Args:
        functions: the offered functions' names (None: no tools; a call stays content).
        parallel: false keeps the first call only.
    """

    def __init__(self, functions: Collection[str] | None = None, parallel: bool = True) -> None:
        self._functions = frozenset(functions or ())
        self._parallel = parallel
        self._pending = ""
        # "begin": whether the reply is harmony is not known yet; "header"; "body"; "text":
        # not harmony, all content.
        self._mode = "begin"
        self._channel = ""
        self._recipient = ""
        self._call = ""  # the body of a call, until it is complete
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> tuple[str, str, list[ParsedCall]]:
        """Takes the next piece of the reply; returns (thinking, content, calls) to send."""
        self._pending += text
        return self._read(final=False)

    def finish(self) -> tuple[str, str, list[ParsedCall]]:
        """The reply ended (its ``<|call|>`` or ``<|return|>`` is not in its text): what was
        held back; a call's body ends here."""
        return self._read(final=True)

    def _read(self, final: bool) -> tuple[str, str, list[ParsedCall]]:
        thinking, content, calls = "", "", list[ParsedCall]()
        while True:
            if self._mode == "begin":
                # A header: after the prompt's <|start|>assistant, a channel, or the recipient
                # first (as gpt-oss's template writes an earlier call: " to=functions.x<|ch").
                head = self._pending.lstrip()
                if head.startswith((CHANNEL, START, "to=")):
                    self._mode = "header"
                elif final or (head and not any(h.startswith(head) for h in _BEGINNINGS)):
                    self._mode = "text"
                else:
                    return thinking, content, calls
            if self._mode == "text":  # the markers are the format's: never the client's
                keep = 0 if final else held_back(self._pending, *HARMONY_MARKERS)
                out = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(out) :]
                return thinking, content + _MARKERS.sub("", out), calls
            if self._mode == "header":
                at = self._pending.find(MESSAGE)
                if at < 0:
                    if final:  # a header cut short: the format's, not the model's words
                        self._pending = ""
                    return thinking, content, calls
                self._open(self._pending[:at])
                self._pending = self._pending[at + len(MESSAGE) :]
                self._mode = "body"
            # A body: up to its end, or what can go out of it now.
            ends = [(i, m) for m in _BODY_ENDS if (i := self._pending.find(m)) >= 0]
            if ends:
                at, marker = min(ends)
                piece = self._pending[:at]
                kept = marker in (START, CHANNEL)  # the next header's own
                self._pending = self._pending[at + (0 if kept else len(marker)) :]
                self._mode = "header"
            elif final:
                piece, self._pending = self._pending, ""
            else:
                keep = held_back(self._pending, *HARMONY_MARKERS)
                piece = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(piece) :]
            piece = _MARKERS.sub("", piece)  # a stray <|message|> or <|constrain|>
            more_thinking, more_content, call = self._body(piece, ended=bool(ends) or final)
            thinking, content = thinking + more_thinking, content + more_content
            calls += call
            if not ends:
                return thinking, content, calls

    def _open(self, header: str) -> None:
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel[1] if channel else ""
        self._recipient = recipient[1] if recipient else ""
        self._call = ""

    def _body(self, piece: str, ended: bool) -> tuple[str, str, list[ParsedCall]]:
        """A piece of the open message's body: (thinking, content, a completed call)."""
        if self._recipient.startswith("functions."):
            self._call += piece
            if not ended:
                return "", "", []
            name = self._recipient.removeprefix("functions.")
            call = call_of_arguments(name, self._call.strip(), self._functions)
            if call is None:  # not a call of an offered function: its text
                return "", self._call, []
            if self.calls and not self._parallel:
                return "", "", []
            self.calls.append(call)
            return "", "", [call]
        if self._channel == "analysis":
            return piece, "", []
        return "", piece, []  # final, a preamble, or a channel of another name
