"""Benchmark of the offline demo pair: quality, acceptance, and the headroom distillation finds.

Run from the repository root (builds the pair first if it is not cached, ~6-8 min)::

    python -m bench.bench_demo_models [--scale full] [--distill-domains code] [--prompts 20]

Prints one table: per domain, held-out perplexity of target and draft; the base draft's
acceptance rate against the target (block verification, k = 4, temperature 0 and 1); the
acceptance of a LoRA adapter distilled offline on that domain's training text (forward KL to the
target's distribution, :mod:`osd.demo.distill`) on the same held-out prompts; and greedy tokens/s
of the target alone versus speculative decoding with the base draft and with the adapter. Also
the target/draft cost of a 1-token decode step. All numbers are measured in this run; they are
saved to ``<cache>/bench.json``. There is no pass or fail: the adapter's gain over the base draft
is the headroom the online trainer must capture.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from bench.cpu import add_threads_argument, apply_bench_threads
from bench.tables import print_table
from osd import SpeculativeDecoder
from osd.demo import DOMAINS, build_demo_models, load_corpus_split
from osd.demo.distill import DistillRecipe, distill_adapter
from osd.demo.evaluation import measure_acceptance, measure_throughput
from osd.demo.report import format_report, load_pair, measure_report
from osd.demo.training import encode_streams


def _prompts(corpus: Any, domain: str, count: int) -> list[str]:
    return [doc.prompt for doc in load_corpus_split(corpus, domain, "heldout")[:count]]


def bench_distillation(
    paths: Any, domains: Sequence[str], recipe: DistillRecipe, num_prompts: int, max_tokens: int
) -> dict[str, Any]:
    """Distills one adapter per domain onto one peft draft; measures each on its domain."""
    target, draft, tokenizer = load_pair(paths)
    texts = {d: [doc.text for doc in load_corpus_split(paths.corpus, d, "train")] for d in domains}
    streams = encode_streams(tokenizer, texts)
    results: dict[str, Any] = {}
    for domain in domains:
        outcome = distill_adapter(target, draft, streams, domain, recipe)
        draft = outcome.draft
        tail = outcome.losses[-20:]
        results[domain] = {
            "seconds": outcome.seconds,
            "kl_first": outcome.losses[0],
            "kl_last": sum(tail) / len(tail),
        }
        print(
            f"distilled {domain!r}: {recipe.steps} steps in {outcome.seconds:.0f}s, "
            f"KL {outcome.losses[0]:.2f} -> {results[domain]['kl_last']:.2f}",
            flush=True,
        )
    engine = SpeculativeDecoder(target, draft, tokenizer)
    for domain in domains:
        prompts = _prompts(paths.corpus, domain, num_prompts)
        row = results[domain]
        for temperature in (0.0, 1.0):
            for adapter in (None, domain):
                result = measure_acceptance(
                    engine, prompts, temperature=temperature, max_tokens=max_tokens, adapter=adapter
                )
                label = "adapter" if adapter else "base"
                row[f"acceptance_{label}_t{temperature:g}"] = result.acceptance_rate
        speed = measure_throughput(
            engine, prompts[: max(1, num_prompts // 2)], max_tokens=max_tokens, adapter=domain
        )
        row["speculative_adapter_tok_s"] = speed.speculative_tokens_per_s
        row["target_only_tok_s"] = speed.target_only_tokens_per_s
        prose = _prompts(paths.corpus, "prose", num_prompts)
        row["acceptance_adapter_on_prose_t0"] = measure_acceptance(
            engine, prose, temperature=0.0, max_tokens=max_tokens, adapter=domain
        ).acceptance_rate
    return results


def _print_summary(report: dict[str, Any], distilled: dict[str, Any]) -> None:
    rows = []
    for domain in DOMAINS:
        r, d = report["domains"][domain], distilled.get(domain, {})

        def cell(key: str, source: dict[str, Any], fmt: str = "{:.3f}") -> str:
            return fmt.format(source[key]) if key in source else "-"

        gain = (
            f"{d['acceptance_adapter_t0'] - d['acceptance_base_t0']:+.3f}"
            if "acceptance_adapter_t0" in d
            else "-"
        )
        rows.append(
            [
                domain,
                f"{r['ppl_target']:.2f}",
                f"{r['ppl_draft']:.2f}",
                f"{r['acceptance_t0']:.3f}",
                f"{r['acceptance_t1']:.3f}",
                cell("acceptance_adapter_t0", d),
                cell("acceptance_adapter_t1", d),
                gain,
                f"{r['target_only_tok_s']:.0f}",
                f"{r['speculative_tok_s']:.0f}",
                cell("speculative_adapter_tok_s", d, "{:.0f}"),
            ]
        )
    header = [
        "domain",
        "ppl target",
        "ppl draft",
        "base acc t=0",
        "base acc t=1",
        "adapter acc t=0",
        "adapter acc t=1",
        "gain t=0",
        "target tok/s",
        "spec tok/s",
        "spec+adapter tok/s",
    ]
    cost = report["decode_ms"]
    print_table(
        f"demo pair {report['scale']}-{report['recipe_hash']}: decode step target "
        f"{cost['target']:.2f} ms / draft {cost['draft']:.2f} ms = {cost['ratio']:.1f}x",
        header,
        rows,
    )
    print(
        "\nacceptance: block verification, k=4, held-out prompts; 'adapter' is a LoRA distilled "
        "offline on that domain (its row only); tok/s: greedy, min of 2 runs per prompt"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scale", choices=["tiny", "full"], default="full")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--distill-domains", default="code", help="comma-separated domains")
    parser.add_argument("--distill-steps", type=int, default=DistillRecipe.steps)
    parser.add_argument("--prompts", type=int, default=20, help="held-out prompts per domain")
    parser.add_argument("--max-tokens", type=int, default=48)
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    threads = apply_bench_threads(args.threads)
    domains = [d.strip() for d in args.distill_domains.split(",") if d.strip()]
    unknown = sorted(set(domains) - set(DOMAINS))
    if unknown:
        parser.error(f"unknown domains {unknown}; choose from {list(DOMAINS)}")
    started = time.perf_counter()
    paths = build_demo_models(args.cache_dir, args.scale, num_threads=threads)
    report = measure_report(
        paths,
        num_prompts=args.prompts,
        max_tokens=args.max_tokens,
        log=lambda line: print(line, flush=True),
    )
    print(format_report(report))
    recipe = DistillRecipe(steps=args.distill_steps)
    distilled = bench_distillation(paths, domains, recipe, args.prompts, args.max_tokens)
    _print_summary(report, distilled)
    result = {"report": report, "distill_recipe": recipe.__dict__, "distilled": distilled}
    (paths.root / "bench.json").write_text(json.dumps(result, indent=2, default=list))
    print(f"\nsaved {paths.root / 'bench.json'}; bench took {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
