"""The measured report of a built demo pair: what ``osd demo-models report`` prints.

Measures, on held-out data: per-domain perplexity of target and draft, the base draft's
acceptance rate against the target (block verification, k = 4, temperature 0 and 1), greedy
tokens/s of the target alone and of speculative decoding, the 1-token decode cost of each model,
and a few greedy samples. Saved as ``report.json`` next to the models.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from osd.decode.engine import SpeculativeDecoder
from osd.demo.build import STAGES, DemoModelPaths, read_manifest
from osd.demo.corpus import load_corpus_split
from osd.demo.evaluation import (
    decode_step_ms,
    greedy_continuation,
    measure_acceptance,
    measure_throughput,
    perplexity,
)
from osd.demo.recipe import DOMAINS

__all__ = ["REPORT_FILE", "format_report", "load_pair", "machine_info", "measure_report"]

REPORT_FILE = "report.json"


def machine_info() -> dict[str, Any]:
    """CPU model, core count and torch threads, for the record of where numbers came from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def load_pair(paths: DemoModelPaths) -> tuple[Any, Any, Any]:
    """Loads (target, draft, tokenizer) from a built cache on the CPU, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(paths.target).eval()
    draft = AutoModelForCausalLM.from_pretrained(paths.draft).eval()
    return target, draft, AutoTokenizer.from_pretrained(paths.tokenizer)


def _build_info(paths: DemoModelPaths) -> dict[str, Any]:
    manifests = {stage: read_manifest(paths.root, stage) or {} for stage in STAGES}
    return {
        "stage_seconds": {s: m.get("seconds") for s, m in manifests.items()},
        "stage_cpu_seconds": {s: m.get("cpu_seconds") for s, m in manifests.items()},
        "total_seconds": round(sum(m.get("seconds") or 0 for m in manifests.values()), 1),
        "parameters": {s: manifests[s].get("info", {}).get("parameters") for s in STAGES[2:]},
    }


def measure_report(
    paths: DemoModelPaths,
    *,
    num_prompts: int = 20,
    max_tokens: int = 48,
    num_ppl_docs: int = 64,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Measures the report of a built pair (a minute or two at full scale on 2 cores).

    Args:
        paths: the built pair.
        num_prompts: held-out prompts per domain for acceptance (half that for throughput).
        max_tokens: tokens generated per prompt.
        num_ppl_docs: held-out documents per domain for perplexity.
        log: called with a line per measurement, for progress.
    """
    target, draft, tokenizer = load_pair(paths)
    engine = SpeculativeDecoder(target, draft, tokenizer)
    context = engine.max_context or 256
    target_ms, draft_ms = decode_step_ms(target), decode_step_ms(draft)
    report: dict[str, Any] = {
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "recipe_hash": paths.recipe_hash,
        "scale": paths.scale,
        "build": _build_info(paths),
        "decode_ms": {"target": target_ms, "draft": draft_ms, "ratio": target_ms / draft_ms},
        "settings": {"num_prompts": num_prompts, "max_tokens": max_tokens, "method": "block"},
        "domains": {},
    }
    log(f"decode step: target {target_ms:.2f} ms, draft {draft_ms:.2f} ms")
    for domain in DOMAINS:
        docs = load_corpus_split(paths.corpus, domain, "heldout")
        texts = [d.text for d in docs[:num_ppl_docs]]
        prompts = [d.prompt for d in docs[:num_prompts]]
        row: dict[str, Any] = {
            "ppl_target": perplexity(target, tokenizer, texts, max_len=context),
            "ppl_draft": perplexity(draft, tokenizer, texts, max_len=context),
        }
        for temperature in (0.0, 1.0):
            result = measure_acceptance(
                engine, prompts, temperature=temperature, max_tokens=max_tokens
            )
            row[f"acceptance_t{temperature:g}"] = result.acceptance_rate
            row[f"tokens_per_step_t{temperature:g}"] = result.tokens_per_step
        speed = measure_throughput(
            engine, prompts[: max(1, num_prompts // 2)], max_tokens=max_tokens
        )
        row["target_only_tok_s"] = speed.target_only_tokens_per_s
        row["speculative_tok_s"] = speed.speculative_tokens_per_s
        row["samples"] = [
            {"prompt": p, "target_greedy": greedy_continuation(engine, p, max_tokens)}
            for p in prompts[:2]
        ]
        report["domains"][domain] = row
        log(
            f"{domain}: ppl target {row['ppl_target']:.2f} draft {row['ppl_draft']:.2f}, "
            f"acceptance t0 {row['acceptance_t0']:.3f} t1 {row['acceptance_t1']:.3f}"
        )
    return report


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    """The report as text tables."""
    cost = report["decode_ms"]
    build = report["build"]
    params = build["parameters"]
    stage_times = ", ".join(f"{s} {t}s" for s, t in build["stage_seconds"].items())
    out = [
        f"demo pair {report['scale']}-{report['recipe_hash']}, measured {report['measured_at']}",
        f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
        f"{report['machine']['torch_threads']} torch threads",
        f"parameters: target {params['target']:,}, draft {params['draft']:,}",
        f"build: {build['total_seconds']}s ({stage_times})",
        f"1-token decode step: target {cost['target']:.2f} ms, draft {cost['draft']:.2f} ms, "
        f"ratio {cost['ratio']:.1f}x",
        "",
    ]
    header = [
        "domain",
        "ppl target",
        "ppl draft",
        "accept t=0",
        "accept t=1",
        "tok/step t=0",
        "target tok/s",
        "spec tok/s",
    ]
    rows = [
        [
            d,
            f"{r['ppl_target']:.2f}",
            f"{r['ppl_draft']:.2f}",
            f"{r['acceptance_t0']:.3f}",
            f"{r['acceptance_t1']:.3f}",
            f"{r['tokens_per_step_t0']:.2f}",
            f"{r['target_only_tok_s']:.0f}",
            f"{r['speculative_tok_s']:.0f}",
        ]
        for d, r in report["domains"].items()
    ]
    out.append(_table(header, rows))
    settings = report["settings"]
    out.append(
        f"\nacceptance: base draft vs target, {settings['method']} verification, k=4, "
        f"{settings['num_prompts']} held-out prompts x {settings['max_tokens']} tokens per domain"
    )
    return "\n".join(out)


def save_report(report: dict[str, Any], root: Path) -> Path:
    path = root / REPORT_FILE
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return path
