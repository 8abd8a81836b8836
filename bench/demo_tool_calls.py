"""How the demo target calls tools when it decides (``tool_choice`` auto), and what the grammar
of ``required`` makes of the same prompts (issue 28, item 1).

Every held-out chat of the demo pair that offers tools is rendered as serving renders it, the
target alone (``method none``) answers it greedily, and the reply is read by serving's hermes
parser: of the replies that should be calls, how many parsed as calls of an offered function
and how many named the expected one; of the replies that should be words, how many called
anyway. Then the should-call prompts once more under the ``required`` grammar: how many came
out as valid calls (all, unless the budget ran out). Not a timing: about a minute on two
cores, ``python -m bench.demo_tool_calls`` (builds or installs the demo pair first).
"""

from __future__ import annotations

import argparse
from collections import Counter

from osd import SpeculativeDecoder
from osd.demo import build_demo_models
from osd.demo.chat import render_chat
from osd.demo.corpus import load_corpus_split
from serving.tool_parsers import ToolCallScanner, tool_call_format


def _calls(text: str, names: list[str]) -> list[str]:
    scanner = ToolCallScanner("hermes", names)
    calls = scanner.feed(text)[1] + scanner.finish()[1]
    return [call.name for call in calls]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    paths = build_demo_models(progress=True)
    engine = SpeculativeDecoder(str(paths.target), str(paths.draft))
    counts: Counter[str] = Counter()
    for doc in load_corpus_split(paths.corpus, "chat", "heldout"):
        if doc.chat is None or not doc.chat.tools:
            continue
        names = [tool["function"]["name"] for tool in doc.chat.tools]
        prompt = render_chat(doc.chat.messages, add_generation_prompt=True, tools=doc.chat.tools)
        expected = _calls(doc.text[len(prompt) :], names)
        reply = engine.generate(prompt, max_tokens=args.max_tokens, temperature=0, method="none")
        called = _calls(reply.text, names)
        kind = "call" if expected else "words"
        counts[f"{kind} prompts"] += 1
        counts[f"{kind}: answered with calls"] += bool(called)
        counts[f"{kind}: the expected function first"] += (
            bool(called) and called[:1] == expected[:1]
        )
        if expected:
            functions = [tool["function"] for tool in doc.chat.tools]
            source = tool_call_format("hermes").grammar(functions, parallel=True)
            grammar = engine.grammars.compile("lark", source)
            forced = engine.generate(
                prompt, max_tokens=args.max_tokens, temperature=0, method="none", grammar=grammar
            )
            made = _calls(forced.text, names)
            counts["required: valid calls"] += bool(made)
            counts["required: the expected function first"] += made[:1] == expected[:1]
    for key in sorted(counts):
        print(f"{key:40s} {counts[key]}")


if __name__ == "__main__":
    main()
