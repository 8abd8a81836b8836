"""``osd demo``'s live view: the replica's health polled while the traffic runs, and the table
of the run so far (acceptance and k per domain, tokens/s against the reference, the adapters in
service, the chats, the loop's health and restarts).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from launcher.demo_report import decode_rate, describe_mix, proposer_mix
from launcher.demo_traffic import Sample, TrafficDriver

__all__ = [
    "describe_chat",
    "describe_loop",
    "describe_workers",
    "live_view",
    "poll_health",
    "recent_by_domain",
    "tokens_per_second",
]


def recent_by_domain(samples: list[Sample], window: int = 20) -> dict[str, dict[str, float]]:
    """Per domain, over its last ``window`` speculative requests: acceptance (of the drafted
    tokens; requests that drafted nothing measure none), mean k, and how many requests."""
    out: dict[str, dict[str, float]] = {}
    for domain in sorted({s.domain for s in samples}):
        mine = [s for s in samples if s.domain == domain and not s.reference][-window:]
        drafted = sum(s.drafted for s in mine)
        out[domain] = {
            "acceptance": sum(s.acceptance * s.drafted for s in mine) / drafted
            if drafted
            else float("nan"),
            "mean_k": sum(s.mean_k for s in mine) / len(mine) if mine else float("nan"),
            "requests": sum(s.domain == domain for s in samples),
        }
    return out


def tokens_per_second(samples: list[Sample], now: float, span: float = 30.0) -> float:
    recent = [s for s in samples if s.time > now - span]
    return sum(s.tokens for s in recent) / min(span, max(now, 1e-9))


def describe_loop(health: dict[str, Any], supervision: dict[str, dict[str, Any]]) -> str:
    """One line on the loop: the replica's health verdict with its problems, and what the
    stack restarted (or gave up on)."""
    status = health.get("status", "unknown")
    line = f"loop: {status}" + "".join(f"; {p}" for p in health.get("problems", []))
    for name, part in supervision.items():
        if part["state"] != "running" or part["restarts"]:
            line += f"; {name} {part['state']}, restarted {part['restarts']}x"
            line += f" (last: {part['last_exit']})" if part["last_exit"] else ""
    return line


def describe_workers(health: dict[str, Any]) -> str:
    """One line on a trainer pool (`trainer.workers` > 1), ending in a newline; "" without.
    (Parentheses, not brackets: the live view is rich markup.)"""
    workers = health.get("trainer_workers") or []
    if not workers:
        return ""
    parts = []
    for w in workers:
        role = ", dispatching" if w.get("dispatching") else ""
        adapters = ", ".join(w.get("adapters", [])) or "none"
        parts.append(f"{w.get('worker')} ({adapters}) lag {w.get('lag', 0)}{role}")
    return f"trainer workers: {'; '.join(parts)}\n"


def describe_chat(samples: list[Sample]) -> str:
    """One line on the chats (/v1/chat/completions) so far, ending in a newline; "" if none."""
    chats = [s for s in samples if s.endpoint == "chat"]
    if not chats:
        return ""
    empty = sum(s.text_chars == 0 for s in chats)
    topics = ", ".join(
        f"{t} {sum(s.topic == t for s in chats)}" for t in sorted({s.topic for s in chats})
    )
    tooled = [s for s in chats if s.tools_offered]
    calling = sum(s.tool_calls > 0 for s in tooled)
    tools = f", {len(tooled)} offered tools ({calling} called one)" if tooled else ""
    return (
        f"chat (/v1/chat/completions, openai client): {len(chats)} ({topics}), {empty} empty"
        f"{tools}\n"
    )


def live_view(
    driver: TrafficDriver,
    health: dict[str, Any],
    total: int,
    supervision: dict[str, dict[str, Any]] | None = None,
) -> Any:
    """A rich table of the run so far."""
    from rich.table import Table

    now = time.monotonic() - driver.start_time
    samples = list(driver.samples)
    table = Table(
        title=f"osd demo  {now:6.0f}s  requests {len(samples)}/{total}  "
        f"failed {driver.failures}  {tokens_per_second(samples, now):.1f} tok/s"
    )
    table.add_column("domain")
    table.add_column("acceptance (last 20)", justify="right")
    table.add_column("k chosen (mean)", justify="right")
    table.add_column("drafted by (last 20)")
    table.add_column("requests", justify="right")
    for domain, numbers in recent_by_domain(samples).items():
        recent = [s for s in samples if s.domain == domain and not s.reference][-20:]
        table.add_row(
            domain,
            f"{numbers['acceptance']:.3f}",
            f"{numbers['mean_k']:.2f}",
            describe_mix(proposer_mix(recent)),
            str(int(numbers["requests"])),
        )
    # The last 40 of each kind: decode tokens/s, speculation on against off.
    spec = decode_rate([s for s in samples if not s.reference][-40:]) or float("nan")
    alone = decode_rate([s for s in samples if s.reference][-40:]) or float("nan")
    versions = ", ".join(f"{a} v{v}" for a, v in health.get("adapters", {}).items())
    table.caption = (
        f"decoding: {spec:.1f} tok/s per request speculative, {alone:.1f} with speculation off "
        f"(reference requests): {spec / alone:.2f}x\n"
        f"drafted by (whole run): {describe_mix(proposer_mix(samples))}\n"
        f"adapters in service: {versions}\n"
        + describe_chat(samples)
        + describe_workers(health)
        + describe_loop(health, supervision or {})
    )
    return table


def poll_health(
    base_url: str, into: dict[str, Any], events: dict[tuple, dict], stop: threading.Event
) -> None:
    """Keeps the replica's adapter versions and swap/rollback events (deduplicated)."""
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            try:
                health = client.get(f"{base_url}/health").json()
                into.update(health)
                for event in health.get("adapter_events", []):
                    events[(event["event"], event["adapter"], event["version"], event["time"])] = (
                        event
                    )
            except (httpx.HTTPError, ValueError):
                pass
            stop.wait(1.0)
