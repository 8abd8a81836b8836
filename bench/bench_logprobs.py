"""What logprobs cost a batched speculative step (issue 14, item 3).

One :class:`osd.decode.loop.BatchedEngine`, a batch of 8 greedy rows (block verification, k=4) on
a tiny random pair with a realistic vocabulary (32k: the log-softmax and top-n are over it),
each variant decoding the same tokens: no row asks for logprobs, half of the rows ask, every
row asks (with 0, 5 and 20 alternatives). Times :func:`osd.decode.step.run_step` alone and
prints the median milliseconds per step over interleaved repeats, and the ratio to no
logprobs; then the logprobs' own work (:func:`osd.decode.logprobs.gather_logprobs` and reading
it back, the fastest of 40) on a step's logits, which a busy machine's step-to-step noise can
hide. Under a minute on two cores: ``python -m bench.bench_logprobs``.
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
from osd.decode.logprobs import gather_logprobs
from osd.testing import noisy_copy, tiny_llama

BATCH = 8
VARIANTS: dict[str, list[int | None]] = {
    "off": [None] * BATCH,
    "half the rows, 5": [5, None] * (BATCH // 2),
    "every row, 0": [0] * BATCH,
    "every row, 5": [5] * BATCH,
    "every row, 20": [20] * BATCH,
}


def step_seconds(decoder: SpeculativeDecoder, logprobs: list[int | None], tokens: int) -> float:
    """Median seconds of the batched steps decoding one batch with these logprobs per row."""
    requests = [
        decoder.prepare(
            [3 + b, 5, 7 + b, 9],
            max_tokens=tokens,
            temperature=0,
            method="block",
            num_spec_tokens=4,
            stop_token_ids=[],
            logprobs=n,
        )
        for b, n in enumerate(logprobs)
    ]
    times = step_times(decoder, requests)
    return statistics.median(times)


def op_milliseconds(vocab: int, num_rows: int, num_top: int, repeats: int = 40) -> float:
    """Fastest of ``repeats`` milliseconds of the logprobs of ``num_rows`` rows of a k=4 step,
    read back (the fastest: on a shared machine, others' work lands on some repeats)."""
    logits = torch.randn(BATCH, 5, vocab)  # (B, k + 1, V)
    token_ids = torch.randint(0, vocab, (BATCH, 5))
    members = list(range(num_rows))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gather_logprobs(
            logits, torch.arange(BATCH), token_ids, members, [num_top] * num_rows
        ).rows()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per row")
    parser.add_argument("--repeats", type=int, default=3)
    add_threads_argument(parser)
    args = parser.parse_args()
    apply_bench_threads(args.threads)
    # First: once the decode loop's thread has run, its idle OpenMP workers spin beside this
    # thread's and the op's time is theirs (osd.threads).
    op_rows = [
        (n, *(f"{op_milliseconds(args.vocab, n, top):.2f} ms" for top in (0, 5, 20)))
        for n in (1, 4, BATCH)
    ]
    # Peaked, so the draft is often accepted and steps emit several tokens.
    target = tiny_llama(vocab_size=args.vocab, hidden_size=128, num_layers=2, seed=1, logit_scale=8)
    decoder = SpeculativeDecoder(target, noisy_copy(target, 0.2, seed=2), None)
    step_seconds(decoder, VARIANTS["every row, 5"], 8)  # warm up
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):  # interleaved: drift hits every variant alike
        for name, logprobs in VARIANTS.items():
            seconds[name].append(step_seconds(decoder, logprobs, args.tokens))
    base = statistics.median(seconds["off"])
    rows = [
        (name, f"{statistics.median(s) * 1e3:.2f}", f"{statistics.median(s) / base:.3f}")
        for name, s in seconds.items()
    ]
    print_table(
        f"run_step with logprobs: batch {BATCH}, block k=4, vocab {args.vocab}, {decoder.device}",
        ["logprobs", "ms/step", "vs off"],
        rows,
    )
    print_table(
        f"the logprobs alone: a k=4 step's logits, vocab {args.vocab}, cpu",
        ["rows asking", "0 alternatives", "5", "20"],
        op_rows,
    )


if __name__ == "__main__":
    main()
