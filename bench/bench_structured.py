"""What structured output costs a batched speculative step (issue 14, item 2).

One :class:`osd.decode.loop.BatchedEngine`, a batch of 8 sampled rows (block verification, k=4)
on a tiny random pair with a realistic byte-level BPE vocabulary (trained here on the Python
standard library's sources, about 28k tokens: llguidance's mask work grows with the
vocabulary), each variant decoding the same prompts: no row constrained, half the rows under
JSON mode (``json_object``), every row under JSON mode, every row under a JSON schema. Times
:func:`osd.decode.step.run_step` alone and prints the median milliseconds per step over
interleaved repeats and the ratio to no grammar, then the masks' own work per step (the k + 1
masks of every row, filled in llguidance's thread pool, with the tokens consumed and rolled
back; the fastest of 20), which a busy machine's step-to-step noise can hide. About two
minutes on two cores: ``python -m bench.bench_structured``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.cpu import add_threads_argument, apply_bench_threads
from bench.step_timer import step_times
from bench.tables import print_table
from osd import SpeculativeDecoder
from osd.decode.grammar import Grammar
from osd.decode.grammar_masks import GrammarMasks
from osd.decode.rows import Row
from osd.demo.corpus import stdlib_files
from osd.demo.recipe import TokenizerRecipe
from osd.demo.vocab import train_tokenizer
from osd.testing import noisy_copy, tiny_llama

BATCH = 8
K = 4
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "size": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "size", "tags"],
}


def step_seconds(
    decoder: SpeculativeDecoder, grammars: list[Grammar | None], tokens: int
) -> tuple[float, int]:
    """Median seconds of the batched steps decoding one batch, and the steps taken."""
    requests = [
        decoder.prepare(
            "x = ",
            max_tokens=tokens,
            seed=b,
            method="block",
            num_spec_tokens=K,
            grammar=grammar,
            log=False,
        )
        for b, grammar in enumerate(grammars)
    ]
    times = step_times(decoder, requests)
    return statistics.median(times), len(times)


def mask_milliseconds(decoder: SpeculativeDecoder, grammar: Grammar, repeats: int = 20) -> float:
    """Fastest of ``repeats`` milliseconds of one step's masks for a batch of rows under
    ``grammar`` a few tokens into their output: position 0, k drafted tokens consumed with a
    mask after each, then the commit (roll back, consume what was kept)."""
    tokenizer = decoder.tokenizer
    prefix = tokenizer.encode('{"name":"osd","size":1', add_special_tokens=False)
    rows = []
    for b in range(BATCH):
        request = decoder.prepare([1], max_tokens=64, grammar=grammar, log=False)
        row = Row(request, tokenizer, slots=[b])
        assert row.matcher.consume_tokens(prefix[:-K])
        rows.append(row)
    drafted = torch.tensor([prefix[-K:]] * BATCH).unsqueeze(1)  # (B, 1, k): allowed tokens
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        masks = GrammarMasks(rows, [K] * BATCH, [1] * BATCH, K, decoder.vocab_size, decoder.device)
        for position in range(1, K + 1):
            masks.advance(position, drafted)
        masks.target_allowed(K + 1)
        masks.commit([prefix[-K:-1]] * BATCH)  # k - 1 kept: the row's matcher consumes them
        times.append(time.perf_counter() - started)
        for row in rows:
            row.matcher.rollback(K - 1)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary to train")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per row")
    parser.add_argument("--repeats", type=int, default=3)
    add_threads_argument(parser)
    args = parser.parse_args()
    apply_bench_threads(args.threads)
    texts = [path.read_text(errors="replace") for path in stdlib_files(max_files=400)]
    tokenizer = train_tokenizer(texts, TokenizerRecipe(vocab_size=args.vocab))
    vocab = len(tokenizer)
    # Peaked, so the draft is often accepted and steps emit several tokens.
    target = tiny_llama(vocab_size=vocab, hidden_size=128, num_layers=2, seed=1, logit_scale=8)
    decoder = SpeculativeDecoder(target, noisy_copy(target, 0.2, seed=2), tokenizer)
    json_mode = decoder.grammars.compile("json_object")
    schema = decoder.grammars.compile("json_schema", SCHEMA)
    variants: dict[str, list[Grammar | None]] = {
        "off": [None] * BATCH,
        "half the rows, json_object": [json_mode, None] * (BATCH // 2),
        "every row, json_object": [json_mode] * BATCH,
        "every row, json_schema": [schema] * BATCH,
    }
    ops = [
        (name, f"{mask_milliseconds(decoder, g):.2f}")
        for name, g in (("json_object", json_mode), ("json_schema", schema))
    ]
    step_seconds(decoder, variants["every row, json_object"], 8)  # warm up
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    steps: dict[str, int] = {}
    for _ in range(args.repeats):  # interleaved: drift hits every variant alike
        for name, grammars in variants.items():
            median, steps[name] = step_seconds(decoder, grammars, args.tokens)
            seconds[name].append(median)
    base = statistics.median(seconds["off"])
    rows = [
        (
            name,
            f"{statistics.median(s) * 1e3:.2f}",
            f"{statistics.median(s) / base:.3f}",
            steps[name],
        )
        for name, s in seconds.items()
    ]
    print_table(
        f"run_step under a grammar: batch {BATCH}, block k={K}, vocab {vocab}, {decoder.device}",
        ["rows constrained", "ms/step", "vs off", "steps"],
        rows,
    )
    print_table(
        f"the masks alone: one step of {BATCH} rows, k={K} (k + 1 masks a row), vocab {vocab}",
        ["grammar", "ms/step"],
        ops,
    )


if __name__ == "__main__":
    main()
