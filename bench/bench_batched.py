"""The batched decode loop on the demo pair: throughput by concurrency, speculation vs target alone.

In one process: the demo pair, one :class:`osd.decode.loop.BatchedEngine` (as a replica runs it),
closed-loop clients (each sends its next request when the last one ends) at each concurrency,
the same held-out prompts everywhere, greedy, tokens counted from the results. Variants per
domain: the target alone (``method=none`` through the same loop), block verification (k=4)
with the base draft, and with a LoRA adapter distilled offline on that domain (the headroom
the online loop chases; ``--distill-steps 0`` skips it), each with a fixed k and with k
chosen per step by the goodput controller (``auto``; ``--sweep`` adds fixed k = 1..8 to
compare it with the best fixed k). Prints tokens/s, its ratio to
concurrency 1 and to the target alone, p50 time to first token, the mean batch, the share of
a step spent outside the model forwards, and measured speedup against the cost-model bound
``(1 - a^(k+1)) / ((1 - a)(1 + k c))`` at the measured acceptance ``a`` and cost ratio ``c``.

Run alone on a quiet machine: ``python -m bench.bench_batched`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.clients import run_clients
from bench.cpu import add_threads_argument, apply_bench_threads
from bench.tables import print_table
from osd import SpeculativeDecoder
from osd.decode.loop import BatchedEngine
from osd.decode.models import CausalLM
from osd.decode.scheduler import BatchLimits
from osd.demo import build_demo_models, load_corpus_split
from osd.demo.distill import DistillRecipe, distill_adapter
from osd.demo.report import load_pair
from osd.demo.training import encode_streams


@dataclass
class ForwardClock:
    """Wall time and calls of one model's batched forwards (CPU: forwards are synchronous)."""

    seconds: float = 0.0
    calls: int = 0
    rows: list[int] = field(default_factory=list)


def clocked(model: CausalLM, clock: ForwardClock) -> Callable[[], None]:
    """Times ``model.run``; returns the function that undoes it."""
    real = model.run

    def run(plan: Any, cache: Any, **kwargs: Any) -> torch.Tensor:
        started = time.perf_counter()
        out = real(plan, cache, **kwargs)
        if out.is_cuda:
            torch.cuda.synchronize()
        clock.seconds += time.perf_counter() - started
        clock.calls += 1
        clock.rows.append(int(plan.input_ids.shape[0]))
        return out

    model.run = run  # type: ignore[method-assign]
    return lambda: setattr(model, "run", real)


def closed_loop(
    engine: BatchedEngine,
    decoder: SpeculativeDecoder,
    prompts: Sequence[str | tuple[str, dict[str, Any]]],
    concurrency: int,
    num_requests: int,
    request: dict[str, Any],
) -> dict[str, float]:
    """``concurrency`` clients send ``num_requests`` requests in all (a prompt may come with
    settings of its own); returns the figures."""
    lock = threading.Lock()
    order = iter(range(num_requests))
    ttfts: list[float] = []
    totals = {"tokens": 0, "drafted": 0, "accepted": 0}
    lengths: list[int] = []  # tokens drafted at each step of every request

    def client() -> None:
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            started = time.perf_counter()
            prompt = prompts[i % len(prompts)]
            extra: dict[str, Any] = {}
            if isinstance(prompt, tuple):  # (prompt, its own settings: e.g. its route)
                prompt, extra = prompt
            handle = engine.submit(decoder.prepare(prompt, **{**request, **extra}))
            first = None
            for _ in handle:
                first = first or time.perf_counter() - started
            result = handle.result()
            with lock:
                ttfts.append(first or 0.0)
                totals["tokens"] += len(result.token_ids)
                totals["drafted"] += result.stats.drafted
                totals["accepted"] += result.stats.accepted
                lengths.extend(result.stats.draft_lengths[1:])  # [0]: the prefill's token

    elapsed = run_clients(concurrency, client)
    return {
        "tok/s": totals["tokens"] / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "acceptance": totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
        "tokens": totals["tokens"],
        "mean_k": statistics.fmean(lengths) if lengths else 0.0,
        "k_share": {k: round(lengths.count(k) / len(lengths), 3) for k in sorted(set(lengths))},
    }


def measure(
    decoder: SpeculativeDecoder,
    prompts: Sequence[str | tuple[str, dict[str, Any]]],
    concurrency: int,
    num_requests: int,
    request: dict[str, Any],
    max_num_seqs: int,
    num_threads: int,
    fuse_prefill: bool = False,
    prefix_caching: bool = True,
) -> dict[str, float]:
    """One variant at one concurrency on a fresh engine, with forward clocks; ``fuse_prefill``
    and ``prefix_caching`` as :class:`BatchLimits` takes them."""
    target_clock, draft_clock = ForwardClock(), ForwardClock()
    undo = [clocked(decoder.target, target_clock), clocked(decoder.draft, draft_clock)]
    limits = BatchLimits(
        max_num_seqs=max_num_seqs,
        max_waiting=1024,
        fuse_prefill=fuse_prefill,
        prefix_caching=prefix_caching,
    )
    engine = BatchedEngine(decoder, limits, num_threads=num_threads)
    try:
        row = closed_loop(engine, decoder, prompts, concurrency, num_requests, request)
    finally:
        engine.close()
        for restore in undo:
            restore()
    stats = engine.stats
    forwards = target_clock.seconds + draft_clock.seconds
    row["mean_batch"] = stats.mean_batch
    row["prefix_hits"] = stats.reused_tokens / max(stats.prompt_tokens, 1)
    # Outside the forwards: scheduling, sampling, verification, bookkeeping (prefill excluded).
    row["overhead"] = max(0.0, 1 - forwards / max(stats.step_seconds, 1e-9))
    row["target_ms"] = 1000 * target_clock.seconds / max(target_clock.calls, 1)
    row["draft_ms"] = 1000 * draft_clock.seconds / max(draft_clock.calls, 1)
    return row


def cost_bound(acceptance: float, k: int, cost_ratio: float) -> float:
    """Expected speedup over the target alone: (1 - a^(k+1)) / ((1 - a)(1 + k c))."""
    a = min(acceptance, 1 - 1e-9)
    return (1 - a ** (k + 1)) / ((1 - a) * (1 + k * cost_ratio))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--domains", default="sql,prose", help="comma-separated demo domains")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument(
        "--requests",
        type=int,
        default=32,
        help="requests per measurement, at least 8 per client (so a measurement spans a few "
        "hundred engine steps: the controller's cold start is part of it, not all of it)",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="drafted tokens per step")
    parser.add_argument(
        "--sweep", action="store_true", help="fixed k = 1..8 too (beside --k's and auto)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure every variant this many times, in rotation; report the median run",
    )
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--distill-steps", type=int, default=DistillRecipe.steps)
    add_threads_argument(parser)
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    threads = apply_bench_threads(args.threads)
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]

    paths = build_demo_models()
    target, draft, tokenizer = load_pair(paths)
    adapters: list[str] = []
    distilled: dict[str, Any] = {}

    def distill() -> None:  # in a thread that ends: see below
        torch.set_num_threads(threads)
        texts = {
            d: [doc.text for doc in load_corpus_split(paths.corpus, d, "train")] for d in domains
        }
        streams = encode_streams(tokenizer, texts)
        model = draft
        for domain in domains:
            if domain == "prose":  # the base draft's own domain
                continue
            outcome = distill_adapter(
                target, model, streams, domain, DistillRecipe(steps=args.distill_steps)
            )
            model = outcome.draft
            adapters.append(domain)
            print(f"distilled {domain!r} in {outcome.seconds:.0f}s", flush=True)
        distilled["draft"] = model

    if args.distill_steps > 0:
        # Training in a thread that then exits: a thread that ran parallel torch work keeps an
        # OpenMP team, and a second team beside the decode loop's halved its speed here.
        worker = threading.Thread(target=distill)
        worker.start()
        worker.join()
        draft = distilled["draft"]
    decoder = SpeculativeDecoder(target, draft, tokenizer)
    greedy = {"max_tokens": args.max_tokens, "temperature": 0.0, "stop_token_ids": []}
    rows: list[dict[str, Any]] = []
    for domain in domains:
        prompts = [d.prompt for d in load_corpus_split(paths.corpus, domain, "heldout")][:64]
        drafts = {
            "base draft": None,
            **({f"{domain} adapter": domain} if domain in adapters else {}),
        }
        lengths: list[int | str] = [*(range(1, 9) if args.sweep else [args.k]), "auto"]
        variants: dict[str, dict[str, Any]] = {"target alone": {"method": "none"}}
        for label, adapter in drafts.items():
            for k in lengths:
                variants[f"block k={k}, {label}"] = {
                    "method": "block",
                    "num_spec_tokens": k,
                    "adapter": adapter,
                    "route": domain,
                }
        warm = BatchedEngine(decoder, num_threads=threads)
        closed_loop(warm, decoder, prompts, 2, 4, {**greedy, "method": "block"})
        warm.close()
        names = list(variants)
        for concurrency in levels:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for repeat in range(args.repeats):  # rotated, so no variant always runs first
                for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    figures = measure(
                        decoder,
                        prompts,
                        concurrency,
                        max(args.requests, 8 * concurrency),
                        {**greedy, **variants[name]},
                        args.max_num_seqs,
                        threads,
                    )
                    runs[name].append(figures)
                    print(json.dumps({"domain": domain, "variant": name, **figures}), flush=True)
            for name in names:
                by_rate = sorted(runs[name], key=lambda f: f["tok/s"])
                median = by_rate[len(by_rate) // 2]
                k = variants[name].get("num_spec_tokens", 0)
                rows.append(
                    {"domain": domain, "variant": name, "conc": concurrency, "k": k, **median}
                )
                rows[-1]["tok/s runs"] = [round(f["tok/s"], 1) for f in runs[name]]
    report(rows, levels)
    report_controller(rows)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


def find(rows: list[dict[str, Any]], domain: str, variant: str, conc: int) -> dict[str, Any] | None:
    for row in rows:
        if (row["domain"], row["variant"], row["conc"]) == (domain, variant, conc):
            return row
    return None


def report(rows: list[dict[str, Any]], levels: list[int]) -> None:
    table = []
    for row in rows:
        alone = find(rows, row["domain"], "target alone", row["conc"])
        first = find(rows, row["domain"], row["variant"], levels[0])
        speedup = row["tok/s"] / alone["tok/s"] if alone else float("nan")
        bound = ""
        if "auto" not in row["variant"] and row["variant"] != "target alone" and alone:
            cost_ratio = row["draft_ms"] / alone["target_ms"]
            expected = cost_bound(row["acceptance"], row["k"], cost_ratio)
            bound = f"{speedup / expected:.2f} (a={row['acceptance']:.2f}, c={cost_ratio:.2f})"
        table.append(
            [
                f"{row['domain']}: {row['variant']}",
                row["conc"],
                f"{row['tok/s']:.0f}",
                f"{row['tok/s'] / first['tok/s']:.2f}x" if first else "",
                f"{speedup:.2f}x",
                f"{row['ttft_p50_ms']:.0f}",
                f"{row['mean_batch']:.1f}",
                f"{row['overhead']:.0%}",
                bound,
            ]
        )
    print_table(
        "batched decode loop, demo pair, greedy (tokens/s; ratios in this run)",
        [
            "domain: variant",
            "conc",
            "tok/s",
            "vs conc 1",
            "vs target",
            "ttft p50 ms",
            "batch",
            "overhead",
            "vs cost bound",
        ],
        table,
    )


def report_controller(rows: list[dict[str, Any]]) -> None:
    """k = auto against the target alone and the best fixed k of the same run (its marks)."""
    table = []
    for row in rows:
        if row["k"] != "auto":
            continue
        draft = row["variant"].split(", ", 1)[1]
        alone = find(rows, row["domain"], "target alone", row["conc"])
        fixed = [
            r
            for r in rows
            if (r["domain"], r["conc"]) == (row["domain"], row["conc"])
            and isinstance(r["k"], int)
            and r["k"] > 0
            and r["variant"].endswith(draft)
        ]
        if alone is None or not fixed:
            continue
        best = max(fixed, key=lambda r: r["tok/s"])
        peer = max(alone["tok/s"], best["tok/s"])
        table.append(
            [
                f"{row['domain']}: {draft}",
                row["conc"],
                f"{row['tok/s']:.0f}",
                f"{row['mean_k']:.2f}",
                f"{alone['tok/s']:.0f}",
                f"k={best['k']}: {best['tok/s']:.0f}",
                f"{row['tok/s'] / alone['tok/s']:.2f}x",
                f"{row['tok/s'] / best['tok/s']:.2f}x",
                f"{row['tok/s'] / peer:.2f}x",
            ]
        )
    print_table(
        "k = auto against its peers in this run (mark: >= 0.97x the better of the two)",
        [
            "domain: draft",
            "conc",
            "auto tok/s",
            "mean k",
            "target alone",
            "best fixed k",
            "vs target",
            "vs best k",
            "vs better",
        ],
        table,
    )


if __name__ == "__main__":
    raise SystemExit(main())
