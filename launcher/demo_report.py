"""The demo's report: report.json, report.png and a W&B run, from the samples of a real run."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from osd.config import OSDConfig

__all__ = [
    "chat_summary",
    "decode_rate",
    "domain_summary",
    "first_versions",
    "reference_summary",
    "rolling",
    "routing_summary",
    "throughput_series",
    "write_report",
]


def rolling(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def domain_summary(samples: list[Any], window: int = 10) -> dict[str, dict[str, float]]:
    """Per domain: acceptance low after the domain's shift, at the end, and the rise.

    Over the speculative requests that drafted (a reference request, or one whose steps all ran
    the target alone, measures no acceptance).
    """
    out = {}
    measured = [s for s in samples if s.drafted and not s.reference]
    for domain in sorted({s.domain for s in measured}):
        series = [s.acceptance for s in measured if s.domain == domain]
        smooth = rolling(series, window)
        if len(series) < window:
            continue
        settled = smooth[window - 1 :]  # full windows only
        low = max(0.0, min(settled[: max(1, len(settled) // 3)]))  # rolling sums' -0.0
        final = sum(series[-window:]) / window
        out[domain] = {
            "requests": len(series),
            "first": smooth[window - 1],
            "low": low,
            "final": final,
            "rise": final - low,
        }
    return out


def _served_adapter(series: list[Any], general: str) -> str | None:
    """The non-general adapter that served most of the last half of ``series`` with a published
    version (unlabeled traffic: a topic the content router found may go to any domain's
    adapter); None: none did."""
    counts: dict[str, int] = {}
    for s in series[len(series) // 2 :]:
        if s.version > 0 and s.adapter != general:
            counts[s.adapter] = counts.get(s.adapter, 0) + 1
    return max(counts, key=lambda a: (counts[a], a)) if counts else None


def first_versions(
    samples: list[Any],
    published: list[dict[str, Any]],
    general: str = "general",
    labels: bool = True,
) -> dict[str, Any]:
    """Per domain with an adapter, counted from the domain's first request (its shift): how
    many of its requests had finished when that adapter's first version was published
    (``published_after``; None: never, or no longer in the store's history), and how many were
    served before the first one drafted by a published version of it (``served_after``). A chat
    counts for the domain it is about.

    A domain's adapter is the one named after it when it served any of the domain's requests
    (labeled traffic: `labels`, then the only one). Otherwise (unlabeled traffic, routed by
    content) it is the non-general
    adapter that served most of the last half of the domain's requests with a published
    version, reported as ``adapter``; failing that, the one named after it if it published a
    first version; a domain with none of these is left out.
    """
    out: dict[str, Any] = {}
    # Version 1 is every adapter's first (numbers go on after a rollback); the store may have
    # deleted it by the end of a long run (bounded history): then it is unknown (None).
    first_at = {e["adapter"]: e["t"] for e in published if e["version"] == 1}
    by_domain: dict[str, list[Any]] = {}
    for sample in sorted(samples, key=lambda s: s.time):
        by_domain.setdefault(getattr(sample, "topic", "") or sample.domain, []).append(sample)
    for domain, series in sorted(by_domain.items()):
        own = domain if domain in first_at else None  # an adapter named after it published
        if any(s.adapter == domain for s in series):
            adapter: str | None = domain
        elif labels:
            adapter = own
        else:
            adapter = _served_adapter(series, general) or own
        if adapter is None:
            continue  # no adapter of its own, none served it
        at = first_at.get(adapter)
        served = [i for i, s in enumerate(series) if s.adapter == adapter and s.version > 0]
        out[domain] = {
            "requests": len(series),
            "published_after": None if at is None else sum(s.time <= at for s in series),
            "served_after": served[0] if served else None,
        }
        if adapter != domain:
            out[domain]["adapter"] = adapter
    return out


def routing_summary(points: list[dict[str, Any]], start: float) -> dict[str, Any]:
    """The content router's accuracy points (``osd.routing.store.RoutingStats``) over the
    run: each one's time since the traffic started, the share of unlabeled requests since the
    previous point served by the best adapter per the logs (``served_accuracy``), the router
    model's own accuracy, its version and outcome; the first and last served accuracy known,
    and how many router versions were published."""
    rows = [
        {
            "t": p["time"] - start,
            "served_accuracy": p.get("served_accuracy"),
            "model_accuracy": p.get("model_accuracy"),
            "version": p.get("version"),
            "outcome": p.get("outcome"),
        }
        for p in points
    ]
    known = [r["served_accuracy"] for r in rows if r["served_accuracy"] is not None]
    return {
        "points": rows,
        "first": known[0] if known else None,
        "last": known[-1] if known else None,
        "published": sum(r["outcome"] == "published" for r in rows),
    }


def chat_summary(samples: list[Any], window: int = 10) -> dict[str, Any]:
    """The requests sent through ``/v1/chat/completions`` (domain ``chat`` in the summary):
    how many, how many answered an empty text, how many offered tools and how many of those
    answered with tool calls, and their acceptance per topic (the domain the chat was about, its
    route key) as :func:`domain_summary` measures it."""
    chats = [s for s in samples if getattr(s, "endpoint", "completions") == "chat"]
    by_topic = [dataclasses.replace(s, domain=s.topic) for s in chats]
    tooled = [s for s in chats if getattr(s, "tools_offered", 0)]
    return {
        "requests": len(chats),
        "empty_responses": sum(s.text_chars == 0 for s in chats),
        "offered_tools": len(tooled),
        "called_tools": sum(s.tool_calls > 0 for s in tooled),
        "tool_calls": sum(s.tool_calls for s in tooled),
        "topics": {t: sum(s.topic == t for s in chats) for t in sorted({s.topic for s in chats})},
        "by_topic": domain_summary(by_topic, window),
    }


def proposer_mix(samples: list[Any]) -> dict[str, dict[str, float]]:
    """Who drafted, over ``samples``' speculative requests: per proposer (``draft``: the draft
    model, ``suffix``, ``ngram``), drafted and accepted tokens, their acceptance, and its share
    of all drafted tokens."""
    totals: dict[str, list[int]] = {}
    for sample in samples:
        if getattr(sample, "reference", False):
            continue
        for name, counts in (getattr(sample, "proposers", None) or {}).items():
            total = totals.setdefault(name, [0, 0])
            total[0] += counts.get("drafted", 0)
            total[1] += counts.get("accepted", 0)
    drafted = sum(t[0] for t in totals.values())
    return {
        name: {
            "drafted": d,
            "accepted": a,
            "acceptance": a / d if d else float("nan"),
            "share": d / drafted if drafted else 0.0,
        }
        for name, (d, a) in sorted(totals.items())
    }


def describe_mix(mix: dict[str, dict[str, float]]) -> str:
    """``suffix 70 % (acc 0.81), draft 30 % (acc 0.55)``: shares of drafted tokens, largest
    first; "none" when nothing was drafted."""
    ranked = sorted(mix.items(), key=lambda item: -item[1]["share"])
    parts = [
        f"{name} {100 * m['share']:.0f} % (acc {m['acceptance']:.2f})"
        for name, m in ranked
        if m["drafted"]
    ]
    return ", ".join(parts) or "none"


def decode_rate(samples: list[Any]) -> float | None:
    """Tokens per second while requests decode: tokens after the first over the replica's time
    from first token to last, summed over ``samples`` (queueing, HTTP and prefill, the same
    with speculation on or off, left out; so is the bias of short requests towards them)."""
    seconds = sum(s.decode_seconds for s in samples)
    tokens = sum(max(s.tokens - 1, 0) for s in samples)
    return tokens / seconds if samples and seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def reference_summary(samples: list[Any]) -> dict[str, dict[str, Any]]:
    """Per phase of the traffic: decode tokens/s with speculation on against off.

    ``reference``: the phase's requests sent with speculation off (the target alone does not
    learn, so all of the phase's count); ``first`` and ``last``: the phase's first and last
    quarter of speculative requests (right after the shift, and after the adapters came);
    ``mean_k``: the draft length the controller chose, over the same quarters.
    """
    out: dict[str, dict[str, Any]] = {}
    for phase in dict.fromkeys(s.phase for s in samples):  # in order of appearance
        spec = [s for s in samples if s.phase == phase and not s.reference]
        alone = decode_rate([s for s in samples if s.phase == phase and s.reference])
        quarter = max(1, len(spec) // 4)
        first, last = spec[:quarter], spec[-quarter:]
        out[phase] = {
            "requests": len(spec),
            "reference_requests": sum(s.phase == phase and s.reference for s in samples),
            "reference": alone,
            "speculative": decode_rate(spec),
            "first": decode_rate(first),
            "last": decode_rate(last),
            "vs_reference": _ratio(decode_rate(spec), alone),
            "first_vs_reference": _ratio(decode_rate(first), alone),
            "last_vs_reference": _ratio(decode_rate(last), alone),
            "mean_k_first": sum(s.mean_k for s in first) / len(first) if first else None,
            "mean_k_last": sum(s.mean_k for s in last) / len(last) if last else None,
        }
    return out


def throughput_series(samples: list[Any], num_bins: int = 20) -> list[tuple[float, float]]:
    """(bin end time, generated tokens/s in the bin); at least 5 s per bin."""
    if not samples:
        return []
    end = max(s.time for s in samples)
    width = max(5.0, end / num_bins)
    bins = [0.0] * (int(end // width) + 1)
    for sample in samples:
        bins[int(sample.time // width)] += sample.tokens
    series = []
    for i, tokens in enumerate(bins):
        span = min(width, end - i * width)  # the last bin may be partial
        if span > 0:
            series.append((i * width + span, tokens / span))
    return series


def domains(samples: list[Any]) -> list[str]:
    return sorted({s.domain for s in samples})


def write_report(result: dict[str, Any], run_dir: Path, config: OSDConfig) -> dict[str, Any]:
    samples, start = result["samples"], result["wall_start"]
    events = [{**e, "t": e["time"] - start} for e in result["events"]]
    published = [{**p, "t": p["time"] - start} for p in result["published"]]
    report = {
        "requests": len(samples),
        "failures": result["failures"],
        "failure_reasons": result.get("failure_reasons", []),
        "loop": result.get("loop", {}),
        "domains": domain_summary(samples),
        "first_versions": first_versions(samples, published, labels=result.get("labels", True)),
        "chat": chat_summary(samples),
        "reference": reference_summary(samples),
        "proposers": {
            "all": proposer_mix(samples),
            **{d: proposer_mix([s for s in samples if s.domain == d]) for d in domains(samples)},
        },
        "labels": result.get("labels", True),
        "routing": routing_summary(result.get("routing", []), start),
        "tokens_per_second": throughput_series(samples),
        "published": published,
        "adapter_events": events,
        "samples": [dataclasses.asdict(s) for s in samples],
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(run_dir / "report.json"), "png": str(run_dir / "report.png")}
    (run_dir / "report.json").write_text(json.dumps(report, indent=1))
    _plot(report, run_dir / "report.png")
    paths["wandb"] = _log_wandb(report, config, run_dir)
    return {**report, "paths": paths}


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, middle, rates, bottom) = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    by_domain: dict[str, list[dict[str, Any]]] = {}
    for sample in report["samples"]:
        if sample["drafted"] and not sample["reference"]:
            by_domain.setdefault(sample["domain"], []).append(sample)
    for domain, rows in sorted(by_domain.items()):
        top.plot(
            [r["time"] for r in rows], rolling([r["acceptance"] for r in rows], 10), label=domain
        )
    for event in report["published"]:
        top.axvline(event["t"], color="grey", linestyle=":", linewidth=0.8)
    for event in report["adapter_events"]:
        color = {"swap": "green", "rollback": "red"}.get(event["event"], "orange")
        top.axvline(event["t"], color=color, linestyle="--", linewidth=0.6, alpha=0.6)
    routed = [p for p in report["routing"]["points"] if p["served_accuracy"] is not None]
    if routed:
        top.plot(
            [p["t"] for p in routed],
            [p["served_accuracy"] for p in routed],
            color="black",
            marker=".",
            label="routing accuracy (served)",
        )
    top.set_ylabel("acceptance rate (rolling 10)")
    top.set_title("acceptance per domain; dotted: published, dashed: swapped in (red: rollback)")
    top.legend(loc="lower right")
    speculative = [s for s in report["samples"] if not s["reference"]]
    for domain in sorted({s["domain"] for s in speculative}):
        rows = [s for s in speculative if s["domain"] == domain]
        middle.plot(
            [r["time"] for r in rows], rolling([r["mean_k"] for r in rows], 10), label=domain
        )
    middle.set_ylabel("k chosen (mean per request, rolling 10)")
    middle.set_title("draft length the goodput controller chose (0: the target alone)")
    middle.legend(loc="upper right")
    for label, reference, style in (("speculative", False, "-"), ("speculation off", True, "--")):
        rows = [s for s in report["samples"] if s["reference"] is reference]
        tokens = rolling([max(r["tokens"] - 1, 0) for r in rows], 4 if reference else 20)
        seconds = rolling([r["decode_seconds"] for r in rows], 4 if reference else 20)
        rates.plot(
            [r["time"] for r in rows],
            [t / max(s, 1e-9) for t, s in zip(tokens, seconds, strict=True)],
            linestyle=style,
            label=label,
        )
    rates.set_ylabel("decode tokens/s per request")
    rates.set_title("decode rate: speculative vs reference requests sent with speculation off")
    rates.legend(loc="upper left")
    series = report["tokens_per_second"]
    bottom.plot([t for t, _ in series], [v for _, v in series], marker="o")
    bottom.set_ylabel("generated tokens/s")
    bottom.set_xlabel("seconds since traffic started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _proposer_fields(sample: dict[str, Any]) -> dict[str, float]:
    """One request's drafted tokens per proposer, and their acceptance, for W&B."""
    out: dict[str, float] = {}
    for name, counts in (sample.get("proposers") or {}).items():
        out[f"drafted_by/{name}"] = counts["drafted"]
        if counts["drafted"]:
            out[f"acceptance_by/{name}"] = counts["accepted"] / counts["drafted"]
    return out


def _log_wandb(report: dict[str, Any], config: OSDConfig, run_dir: Path) -> str:
    if config.wandb.mode == "disabled":
        return ""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=config.wandb.project,
        mode=config.wandb.mode,
        job_type="demo",
        dir=config.wandb.dir or str(run_dir),
        config=dataclasses.asdict(config),
    )
    for sample in report["samples"]:
        run.log(
            {
                "time": sample["time"],
                **(
                    {f"acceptance/{sample['domain']}": sample["acceptance"]}
                    if sample["drafted"]
                    else {}
                ),
                f"k_chosen/{sample['domain']}": sample["mean_k"],
                "reference": sample["reference"],
                "tokens": sample["tokens"],
                "latency": sample["latency"],
                "decode_tokens_per_second": max(sample["tokens"] - 1, 0)
                / max(sample["decode_seconds"], 1e-9),
                **_proposer_fields(sample),
            }
        )
    for domain, numbers in report["domains"].items():
        for key, value in numbers.items():
            run.summary[f"{domain}/{key}"] = value
    for phase, numbers in report["reference"].items():
        for key, value in numbers.items():
            run.summary[f"reference/{phase}/{key}"] = value
    for scope, mix in report["proposers"].items():
        for name, numbers in mix.items():
            for key, value in numbers.items():
                run.summary[f"proposers/{scope}/{name}/{key}"] = value
    run.summary["published_versions"] = len(report["published"])
    for key in ("first", "last"):
        if report["routing"][key] is not None:
            run.summary[f"routing/{key}"] = report["routing"][key]
    run.finish()
    return str(run.dir)
