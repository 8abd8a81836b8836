"""Prefix caching on the demo pair: a joining prompt's shared beginning copied, not prefilled.

In one process, one :class:`osd.decode.loop.BatchedEngine` per measurement (as a replica runs
it), closed-loop clients, greedy, each variant with ``BatchLimits.prefix_caching`` on and off in
alternation (``--repeats`` rotations; the median of each cell is reported). Workloads:

* ``chat``: a fixed system preamble of about 400 characters before each held-out prose prompt,
  as a chat template and system prompt put before every user turn;
* ``repetitive``: the traffic of :mod:`bench.bench_proposers` (verbatim repeats, templates with
  rotating fields, sessions quoting the last answer);
* ``prose``: held-out prose cut to 200 characters (little shared: caching must not cost).

Variants: the target alone (``method=none``) and the default (``proposer=auto``). Printed per
cell: tokens/s with and without caching and their ratio, time to first token p50, and the share
of prompt tokens copied (``LoopStats.reused_tokens / prompt_tokens``). Run alone on a quiet
machine: ``python -m bench.bench_prefix_caching`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.bench_batched import measure
from bench.bench_proposers import repetitive_prompts
from bench.cpu import add_threads_argument, apply_bench_threads
from bench.tables import print_table
from osd import SpeculativeDecoder
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits
from osd.decode.warmup import warm_up
from osd.demo import build_demo_models, load_corpus_split
from osd.demo.report import load_pair

PREAMBLE = (
    "You are a careful assistant for a team of engineers. Answer in plain words, keep to the "
    "question, and say when you do not know. Prefer short paragraphs; put code in fenced "
    "blocks; name the file and function you mean. Never invent a library's API: if unsure, "
    "say what you would check first. The user's message follows.\n\nUser: "
)
VARIANTS: dict[str, dict[str, Any]] = {
    "target alone": {"method": "none"},
    "auto": {"method": "block", "proposer": "auto"},
}


def prose(corpus: Any) -> list[str]:
    return [d.text[:200] for d in load_corpus_split(corpus, "prose", "heldout") if d.text.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workloads", default="chat,repetitive,prose")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests", type=int, default=64, help="per measurement (>= 8 a client)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="rotations of on / off")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--compile", action="store_true", help="as a replica runs (warm-up first)")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    threads = apply_bench_threads(args.threads)
    paths = build_demo_models()
    target, draft, tokenizer = load_pair(paths)
    decoder = SpeculativeDecoder(target, draft, tokenizer, compile_forward=args.compile)
    if args.compile:  # graphs compiled and trials settled before anything is timed
        engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=16), num_threads=threads)
        try:
            print(warm_up(engine).describe(), flush=True)
        finally:
            engine.close()
    workloads = {
        "chat": lambda: [PREAMBLE + p + "\nAssistant:" for p in prose(paths.corpus)],
        "repetitive": lambda: repetitive_prompts(paths.corpus, args.requests),
        "prose": lambda: prose(paths.corpus),
    }
    table = []
    for workload in args.workloads.split(","):
        prompts = workloads[workload]()
        for conc in (int(c) for c in args.concurrency.split(",")):
            for variant in args.variants.split(","):
                runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
                for repeat in range(args.repeats):
                    for caching in (True, False) if repeat % 2 == 0 else (False, True):
                        request = {
                            "max_tokens": args.max_tokens,
                            "temperature": 0.0,
                            "stop_token_ids": [],
                            "log": False,
                            **VARIANTS[variant],
                        }
                        count = max(args.requests, 8 * conc)
                        row = measure(
                            decoder, prompts, conc, count, request, 16, threads, False, caching
                        )
                        runs[caching].append(row)
                        print(
                            f"{workload:10s} c{conc:<3d} {variant:12s} caching "
                            f"{'on ' if caching else 'off'} {row['tok/s']:7.1f} tok/s ttft "
                            f"{row['ttft_p50_ms']:6.1f} ms hits {row['prefix_hits']:.2f}",
                            flush=True,
                        )

                def median(key: str, caching: bool, of: dict = runs) -> float:
                    return statistics.median(r[key] for r in of[caching])

                on, off = median("tok/s", True), median("tok/s", False)
                table.append(
                    [
                        workload,
                        conc,
                        variant,
                        f"{on:.1f}",
                        f"{off:.1f}",
                        f"{on / off:.2f}x",
                        f"{median('ttft_p50_ms', True):.1f}",
                        f"{median('ttft_p50_ms', False):.1f}",
                        f"{median('prefix_hits', True):.2f}",
                    ]
                )
    print_table(
        f"Prefix caching on the demo pair (greedy, {args.max_tokens} tokens, closed loop, "
        f"{'compiled' if args.compile else 'eager'}, medians of {args.repeats})",
        [
            "workload",
            "conc",
            "variant",
            "tok/s on",
            "tok/s off",
            "on / off",
            "TTFT p50 on",
            "TTFT p50 off",
            "prompt share copied",
        ],
        table,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
