"""Reasoning models' thinking read apart from their answer: ``<think> ... </think>`` (Qwen3,
QwQ, DeepSeek-R1 and its distillations, GLM-4.5), answered as the message's ``reasoning``
(vLLM's field; ``reasoning_content`` too, its older name that DeepSeek's API and many clients
read), the rest as ``content``. Tool calls are read from the content alone.

``serve.reasoning_parser`` (vLLM's ``--reasoning-parser``): ``auto`` (the default: ``qwen3``
where the chat template writes ``</think>``, ``gemma4`` where it writes ``<channel|>``,
``openai_gptoss`` where it writes harmony's messages), ``qwen3``, ``deepseek_r1``, ``gemma4``
(Gemma 4's ``<|channel>thought\n ... <channel|>``, which its replies open themselves, the
channel's name left out of the thinking; a reply that starts with the name alone, as some
checkpoints write it, thinks too), ``openai_gptoss`` (gpt-oss's analysis channel, read
by :mod:`serving.harmony`) or ``none`` (the thinking stays in the content). A reply is thinking
from its start where the prompt ends inside ``<think>`` (templates that open it for the model:
DeepSeek-R1's, Qwen3's thinking models') or where the reply opens it; with ``deepseek_r1``
always (its models may leave ``<think>`` out). Thinking ends at ``</think>``; a reply cut
before it is all thinking. Where neither opens it, the reply is all content (Qwen3 with
``enable_thinking: false``, whose template closes an empty ``<think></think>`` in the prompt).
A grammar (structured output, a forced tool call) holds after the thinking where the prompt
opened it (``osd.decode.grammar``'s ``thinking_first``), else from the reply's start, whose
text is then all answer.

:class:`ReasoningReader` reads a reply as it streams, holding back only what may be the start
of a marker and the whitespace around the thinking (which is the template's, not the model's
words); fed whole it gives the same text.
"""

from __future__ import annotations

from serving.tool_parsers import held_back, speaks_harmony

__all__ = ["REASONING_PARSERS", "ReasoningReader", "detect_reasoning", "prompt_opens_thinking"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Gemma 4's thinking: a channel the reply opens, its first line the channel's name.
GEMMA_OPEN, GEMMA_CLOSE, GEMMA_LABEL = "<|channel>", "<channel|>", "thought\n"
# parser -> (the marker that opens thinking, the one that closes it, the label after the
# opening that is the format's, not the model's words)
MARKERS = {
    "qwen3": (THINK_OPEN, THINK_CLOSE, ""),
    "deepseek_r1": (THINK_OPEN, THINK_CLOSE, ""),
    "gemma4": (GEMMA_OPEN, GEMMA_CLOSE, GEMMA_LABEL),
}
# The parsers this module reads (serve.reasoning_parser's others: openai_gptoss, read by
# serving.harmony).
REASONING_PARSERS = tuple(MARKERS)


def detect_reasoning(chat_template: str | None) -> str | None:
    """The reasoning parser a chat template asks for; None: it shows no thinking."""
    if speaks_harmony(chat_template):
        return "openai_gptoss"  # gpt-oss's analysis channel (serving.harmony)
    if chat_template and THINK_CLOSE in chat_template:
        return "qwen3"
    if chat_template and GEMMA_CLOSE in chat_template:
        return "gemma4"
    return None


def prompt_opens_thinking(prompt_tail: str, parser: str = "qwen3") -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves the model inside thinking: it ends
    with the parser's opening marker (``<think>`` for qwen3's and deepseek_r1's; Gemma 4's
    templates never end with its ``<|channel>``)."""
    return prompt_tail.rstrip().endswith(MARKERS.get(parser, MARKERS["qwen3"])[0])


class ReasoningReader:
    """One reply's thinking and answer, as its text arrives.

    Args:
        parser: one of ``REASONING_PARSERS``.
        opened: the prompt ended inside the thinking.
    """

    def __init__(self, parser: str, opened: bool) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}")
        self._open, self._close, self._label = MARKERS[parser]
        # "start": whether the reply opens thinking is not known yet; "opened": thinking,
        # whether the reply opens it again not known yet; "thinking"; "after" (its close
        # read, the answer's first words not yet); "answer".
        self._state = "opened" if opened or parser == "deepseek_r1" else "start"
        self._pending = ""
        self.thought = False  # thinking text went out (the reply held some)
        self._labelled = not self._label  # the label after the opening was read

    @property
    def closing(self) -> str:
        """The marker that ends the thinking."""
        return self._close

    def feed(self, text: str) -> tuple[str, str]:
        """Takes the next piece of the reply; returns (thinking, answer) to send."""
        self._pending += text
        return self._read(final=False)

    def finish(self) -> tuple[str, str]:
        """The reply ended: what was held back (an unclosed thinking stays thinking)."""
        return self._read(final=True)

    def _read(self, final: bool) -> tuple[str, str]:
        thinking = ""
        if self._state in ("start", "opened"):
            head = self._pending.lstrip()
            if head.startswith(self._open):  # (where already opened, a model's repetition)
                self._pending, self._state = head[len(self._open) :], "thinking"
            elif self._label and head.startswith(self._label):
                # The channel's name without its opening (some Gemma 4 checkpoints write it):
                # thinking, as vLLM's parser reads it.
                self._pending, self._state = head, "thinking"
            elif final or (
                head and not self._open.startswith(head) and not self._label.startswith(head)
            ):
                self._state = "thinking" if self._state == "opened" else "answer"
            else:
                return "", ""
        if self._state == "thinking" and not self._labelled:
            if self._label.startswith(self._pending) and not final:
                return "", ""  # (may be the label still)
            self._pending = self._pending.removeprefix(self._label)
            self._labelled = True
        if self._state == "thinking":
            end = self._pending.find(self._close)
            if end >= 0:
                thinking = self._thought(self._pending[:end].rstrip())
                self._pending, self._state = self._pending[end + len(self._close) :], "after"
            else:
                # What may start the close, and whitespace that may end the thinking, wait.
                keep = 0 if final else held_back(self._pending, self._close)
                out = self._pending[: len(self._pending) - keep].rstrip()
                self._pending = "" if final else self._pending[len(out) :]
                return self._thought(out), ""
        if self._state == "after":  # the whitespace after </think> is the template's
            self._pending = self._pending.lstrip()
            if not self._pending and not final:
                return thinking, ""
            self._state = "answer"
        answer, self._pending = self._pending, ""
        return thinking, answer

    def _thought(self, text: str) -> str:
        """Thinking to send: without the whitespace after its opening."""
        if not self.thought:
            text = text.lstrip()
            self.thought = bool(text)
        return text
