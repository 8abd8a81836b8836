"""The proposers on the demo pair: model-free drafts (suffix decoding, prompt lookup) beside the
draft model, chosen per row and step by the goodput controller.

In one process, one :class:`osd.decode.loop.BatchedEngine` per measurement (as a replica runs
it), closed-loop clients at each concurrency, greedy, tokens counted from the results. Two
workloads:

* ``repetitive``: traffic that repeats itself as real chat and agent traffic does, built here
  from the demo's held-out text (the demo models never trained on these exact requests):
  popular prompts asked again verbatim, templated SQL/JSON requests whose fields rotate, and
  sessions whose next prompt quotes the last answer and asks for more;
* ``prose``: held-out prose, little repetition (the new proposers must not cost there);
* ``sql``: held-out SQL prompts with the draft's ``sql`` LoRA adapter distilled offline first
  (``--distill-steps``; the acceptance the online loop reaches), route ``sql``: does ``auto``
  keep what the learned draft buys;
* ``unfamiliar``: held-out prose with every word spelled backwards, text neither model saw
  (the base draft's acceptance falls to near 0): speculation must cost nothing there;
* ``mixed``: held-out prompts of four domains interleaved, each with its domain as its route:
  the suffix store kept per route (``spec.suffix_scope: route``) against one global store.

Variants: the target alone (``method=none``), the draft model alone (``proposer=draft``,
k by the controller: osd's default before the proposers), suffix decoding alone
(``proposer=suffix``), the default (``proposer=auto``: the controller picks per row and
step), and ``auto`` over per-route stores (``auto (route scope)``). Each measurement starts with
an empty suffix store (what it learns, it learns from the measured traffic). Then the index
itself: memory per million tokens, lookup time, and the time to warm a store from logged
requests.

Greedy unless ``--temperature`` says otherwise; eager forwards unless ``--compile`` (a replica's
default, ``model.compile``: then a warm-up compiles every graph before the first measurement).
Run alone on a quiet machine: ``python -m bench.bench_proposers`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from typing import Any

import torch

from bench.bench_batched import measure
from bench.cpu import add_threads_argument, apply_bench_threads
from bench.tables import print_table
from osd import SpeculativeDecoder
from osd.config import SpecConfig
from osd.decode.loop import BatchedEngine
from osd.decode.proposers import LookupSettings, Proposers, SuffixScope
from osd.decode.proposers.token_index import SuffixStore, continuations
from osd.decode.scheduler import BatchLimits
from osd.decode.warmup import warm_up
from osd.demo import build_demo_models, load_corpus_split
from osd.demo.distill import DistillRecipe, distill_adapter
from osd.demo.report import load_pair
from osd.demo.training import encode_streams

VARIANTS: dict[str, dict[str, Any]] = {
    "target alone": {"method": "none"},
    "draft model": {"method": "block", "proposer": "draft"},
    "suffix": {"method": "block", "proposer": "suffix"},
    "auto": {"method": "block", "proposer": "auto"},
    "auto (route scope)": {"method": "block", "proposer": "auto"},  # per-route suffix stores
}
ROUTE_SCOPED = {"auto (route scope)"}
MIXED_DOMAINS = ("sql", "code", "json", "prose")


def mixed_prompts(corpus: Any) -> list[tuple[str, dict[str, Any]]]:
    """Held-out prompts of four domains interleaved, each with its domain as its route."""
    by_domain = [
        [(d.prompt, {"route": domain}) for d in _split(corpus, domain, "heldout")]
        for domain in MIXED_DOMAINS
    ]
    return [p for group in zip(*by_domain) for p in group]  # noqa: B905 (shortest wins)


def unfamiliar(text: str) -> str:
    """``text`` with every word spelled backwards: text neither demo model saw."""
    return " ".join(word[::-1] for word in text.split())


def repetitive_prompts(corpus: Any, count: int, seed: int = 0) -> list[str]:
    """Requests that repeat themselves: a third popular prompts asked again, a third templated
    requests with rotating fields, a third sessions quoting the last answer (the answer is
    approximated by the held-out continuation of the quoted text)."""
    rng = random.Random(seed)
    docs = {
        d: [doc.text for doc in load_corpus_split(corpus, d, "heldout")] for d in ("sql", "code")
    }
    popular = [text[:160] for text in rng.sample(docs["sql"] + docs["code"], 6)]
    tables = ["orders", "users", "invoices", "events", "payments", "sessions"]
    columns = ["id", "created_at", "amount", "status", "user_id", "country"]
    prompts: list[str] = []
    session = rng.choice(docs["code"])[:120]
    while len(prompts) < count:
        kind = len(prompts) % 3
        if kind == 0:
            prompts.append(rng.choice(popular))
        elif kind == 1:
            table, column = rng.choice(tables), rng.choice(columns)
            prompts.append(
                f'{{"task": "report", "table": "{table}", "column": "{column}", '
                f'"sql": "SELECT {column}, COUNT(*) FROM {table} GROUP BY {column}'
            )
        else:
            prompts.append(f"# Earlier:\n{session}\n# Again, with the same names:\n{session[:60]}")
            session = session[-80:] + "\n" + rng.choice(docs["code"])[:60]
    return prompts


def index_costs(corpus: Any, tokenizer: Any, budget: int) -> dict[str, float]:
    """Memory per million tokens, lookup time, and warm-start time of a store of the corpus."""
    texts = [
        doc.text
        for d in ("sql", "code", "prose", "chat", "json", "math")
        for doc in _split(corpus, d, "train")
    ]
    documents = [tokenizer(text)["input_ids"] for text in texts]
    store = SuffixStore(budget)
    started = time.perf_counter()
    added = 0
    for ids in documents:
        store.add(ids)
        added += len(ids)
        if added >= budget:
            break
    build = time.perf_counter() - started
    rng = random.Random(0)
    contexts = [ids[: rng.randrange(8, max(9, len(ids)))] for ids in rng.sample(documents, 200)]
    started = time.perf_counter()
    hits = sum(continuations(c, store.segments, 8) is not None for c in contexts)
    lookup = (time.perf_counter() - started) / len(contexts)
    warm = Proposers(LookupSettings(budget))
    started = time.perf_counter()
    warm.warm([(ids, "") for ids in documents[:1000]])
    warm_seconds = time.perf_counter() - started
    return {
        "tokens": store.num_tokens,
        "bytes_per_token": store.nbytes() / max(store.num_tokens, 1),  # = MB per million
        "build_us_per_token": 1e6 * build / max(added, 1),
        "lookup_us": 1e6 * lookup,
        "hit_share": hits / len(contexts),
        "warm_1000_docs_s": warm_seconds,
    }


def distilled_draft(
    paths: Any,
    target: Any,
    draft: Any,
    tokenizer: Any,
    domain: str = "sql",
    steps: int = DistillRecipe.steps,
    threads: int = 1,
) -> Any:
    """The draft with a LoRA adapter named ``domain`` distilled offline on that domain's
    training text (in a thread that then ends: a thread that ran parallel torch work keeps an
    OpenMP team that slows the decode loop)."""
    out: dict[str, Any] = {}

    def distill() -> None:
        torch.set_num_threads(threads)
        texts = {domain: [doc.text for doc in load_corpus_split(paths.corpus, domain, "train")]}
        outcome = distill_adapter(
            target, draft, encode_streams(tokenizer, texts), domain, DistillRecipe(steps=steps)
        )
        print(f"distilled {domain!r} in {outcome.seconds:.0f}s", flush=True)
        out["draft"] = outcome.draft

    worker = threading.Thread(target=distill)
    worker.start()
    worker.join()
    return out["draft"]


def _split(corpus: Any, domain: str, split: str) -> list[Any]:
    try:
        return load_corpus_split(corpus, domain, split)
    except ValueError:
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--workloads",
        default="repetitive,prose",
        help="of repetitive, prose, sql, mixed, unfamiliar",
    )
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument(
        "--requests", type=int, default=48, help="requests per measurement (>= 8 a client)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--budget", type=int, default=500_000, help="suffix store tokens")
    parser.add_argument(
        "--distill-steps",
        type=int,
        default=DistillRecipe.steps,
        help="steps of the sql adapter's offline distillation (sql workload)",
    )
    add_threads_argument(parser)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the models' layers through torch.compile, as a replica runs them by default "
        "(model.compile), every graph compiled in a warm-up before the first measurement; "
        "without it the forwards run eagerly",
    )
    parser.add_argument(
        "--riders",
        action="store_true",
        help="a joining prompt read in the decode step, one a turn (BatchLimits.fuse_prefill "
        "on; off by default: every prompt in a prefill forward of its own)",
    )
    parser.add_argument(
        "--max-spec-tokens",
        type=int,
        default=SpecConfig.max_spec_tokens,
        help="the most tokens a row drafts a step under auto (spec.max_spec_tokens)",
    )
    parser.add_argument(
        "--max-lookup-tokens",
        type=int,
        default=SpecConfig.max_lookup_tokens,
        help="the most tokens a looked-up draft verifies a step under auto "
        "(spec.max_lookup_tokens)",
    )
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    threads = apply_bench_threads(args.threads)
    paths = build_demo_models()
    target, draft, tokenizer = load_pair(paths)
    names = args.workloads.split(",")
    per_workload: dict[str, dict[str, Any]] = {w: {} for w in names}
    if "sql" in names and args.distill_steps > 0:
        draft = distilled_draft(paths, target, draft, tokenizer, "sql", args.distill_steps, threads)
        per_workload["sql"] = {"adapter": "sql", "route": "sql"}
    decoder = SpeculativeDecoder(
        target,
        draft,
        tokenizer,
        suffix_budget=args.budget,
        compile_forward=args.compile,
        max_spec_tokens=args.max_spec_tokens,
        max_lookup_tokens=args.max_lookup_tokens,
    )
    if args.compile:  # graphs compiled and trials settled before anything is timed
        engine = BatchedEngine(
            decoder,
            BatchLimits(max_num_seqs=16, max_waiting=1024, fuse_prefill=args.riders),
            num_threads=threads,
        )
        try:
            print(warm_up(engine).describe(), flush=True)
        finally:
            engine.close()
    workloads: dict[str, Any] = {
        "repetitive": lambda: repetitive_prompts(paths.corpus, args.requests),
        "prose": lambda: [d.text[:200] for d in _split(paths.corpus, "prose", "heldout")],
        "sql": lambda: [d.prompt for d in _split(paths.corpus, "sql", "heldout")][:64],
        "mixed": lambda: mixed_prompts(paths.corpus),
        "unfamiliar": lambda: [
            unfamiliar(d.text[:200]) for d in _split(paths.corpus, "prose", "heldout")
        ],
    }
    rows: list[dict[str, Any]] = []
    for workload in names:
        prompts = workloads[workload]()
        for conc in (int(c) for c in args.concurrency.split(",")):
            for variant in args.variants.split(","):
                if variant in ROUTE_SCOPED and workload != "mixed":
                    continue  # one store per route differs from one store on mixed routes only
                scope: SuffixScope = "route" if variant in ROUTE_SCOPED else "global"
                # Learns from scratch.
                decoder.proposers = Proposers(
                    LookupSettings(args.budget, scope, args.max_lookup_tokens)
                )
                request = {
                    "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "stop_token_ids": [],
                    "log": False,
                    **VARIANTS[variant],
                    **per_workload[workload],
                }
                # At least 8 requests a client: the controller's cold start is part of a
                # measurement, not all of it.
                count = max(args.requests, 8 * conc)
                row = measure(decoder, prompts, conc, count, request, 16, threads, args.riders)
                row |= {"workload": workload, "variant": variant, "concurrency": conc}
                rows.append(row)
                print(
                    f"{workload:10s} c{conc:<3d} {variant:17s} {row['tok/s']:7.1f} tok/s "
                    f"acc {row['acceptance']:.2f} mean k {row['mean_k']:.2f}",
                    flush=True,
                )

    def rate_of(variant: str, like: dict[str, Any]) -> float:
        """tok/s of ``variant`` in ``like``'s workload and concurrency (nan: not measured)."""
        return next(
            (
                r["tok/s"]
                for r in rows
                if r["variant"] == variant
                and r["workload"] == like["workload"]
                and r["concurrency"] == like["concurrency"]
            ),
            float("nan"),
        )

    sampled = "greedy" if args.temperature == 0 else f"T = {args.temperature:g}"
    table = []
    for row in rows:
        alone, model = rate_of("target alone", row), rate_of("draft model", row)
        best_single = max(model, rate_of("suffix", row))  # nan if either is not measured
        table.append(
            [
                row["workload"],
                row["concurrency"],
                row["variant"],
                f"{row['tok/s']:.1f}",
                f"{row['tok/s'] / alone:.2f}x",
                f"{row['tok/s'] / model:.2f}x",
                f"{row['tok/s'] / best_single:.2f}x",
                f"{row['acceptance']:.2f}",
                f"{row['mean_k']:.2f}",
            ]
        )
    print_table(
        f"Proposers on the demo pair ({sampled}, {args.max_tokens} tokens, closed loop, "
        f"{'compiled' if args.compile else 'eager'})",
        [
            "workload",
            "conc",
            "variant",
            "tok/s",
            "/ target",
            "/ draft model",
            "/ max(draft, suffix)",
            "accept",
            "mean k",
        ],
        table,
    )
    costs = index_costs(paths.corpus, tokenizer, args.budget)
    print_table(
        "The suffix index (demo corpus, train splits)",
        list(costs),
        [[f"{v:.3g}" for v in costs.values()]],
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "index": costs}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
