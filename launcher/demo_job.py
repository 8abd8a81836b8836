"""``osd demo``: the main job. The whole online loop on this machine, learning on its traffic.

Builds (or reuses) the demo models, starts the embedded stack (redis-server, local Ray, the
Serve app, the trainer), drives the demo workload through the real HTTP API while the domain mix
shifts, and shows acceptance per domain, tokens/s and adapter versions live. A share of the
requests (a window of ``concurrency`` consecutive ones in every ``reference_every``) is sent
with speculation off: their tokens/s is the target-only reference, measured in the same run,
that the speculative requests are compared with. A share of the requests (``--chat-share``) are
chats on their domain, sent through ``/v1/chat/completions`` with the official ``openai`` client
and reported as the ``chat`` domain (routed by their topic, so the domain's adapter serves and
learns from them). At the end it writes ``report.json`` and ``report.png`` into the run
directory, logs a W&B run (offline by default) and stops everything it started, also on Ctrl-C.
Every number comes from the running system: responses' own speculative stats, the replica's
adapter events, the store's versions.

The traffic is :mod:`launcher.demo_traffic`'s, the live view :mod:`launcher.demo_live`'s and the
report :mod:`launcher.demo_report`'s; this module builds the workload, runs them and prints the end.
"""

from __future__ import annotations

import argparse
import functools
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.demo_live import describe_loop, live_view, poll_health
from launcher.demo_report import describe_mix, write_report
from launcher.demo_traffic import TrafficDriver
from launcher.stack import LocalStack, install_signal_handlers
from osd.config import OSDConfig, load_config

__all__ = ["main"]


def demo_workload(schedule: str, max_tokens: int, seed: int, chat_share: float = 0.0) -> list[Any]:
    """The demo's traffic: held-out prompts of each domain, in the order of ``schedule``, a
    ``chat_share`` of each domain's requests held-out chats on it."""
    from osd.demo import (
        TEXT_DOMAINS,
        build_demo_models,
        heldout_dialogues,
        heldout_prompts,
        make_workload,
        parse_schedule,
    )

    paths = build_demo_models(progress=True)
    prompts = heldout_prompts(paths.corpus, TEXT_DOMAINS)
    items = make_workload(
        prompts,
        parse_schedule(schedule),
        max_tokens=max_tokens,
        seed=seed,
        dialogues=heldout_dialogues(paths.corpus),
        chat_share=chat_share,
    )
    return list(items)


TRAINER_START_S = 300.0  # the trainer loads the draft and resumes; then it beats


def set_aside_previous_run(run_dir: Path) -> Path | None:
    """Renames a previous run's directory to ``<run_dir>-<time>`` and returns where it went.

    The demo shows drafts adapting to shifts from the base draft: a run that resumed the last
    one's redis-server data (its adapter versions, its unread records) would start adapted.
    Nothing is deleted. None: there was no previous run.
    """
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}-{stamp}")
    suffix = 1
    while target.exists():
        target = run_dir.with_name(f"{run_dir.name}-{stamp}-{suffix}")
        suffix += 1
    run_dir.rename(target)
    return target


def run(
    config: OSDConfig,
    items: list[Any],
    concurrency: int,
    reference_every: int = 10,
    *,
    labels: bool = True,
) -> dict[str, Any]:
    """Runs the stack and the traffic; returns what the report needs. ``labels=False``: the
    requests carry no domain, the replica routes them by content."""
    from rich.live import Live

    stack = LocalStack(config)
    health: dict[str, Any] = {}
    events: dict[tuple, dict] = {}
    stop = threading.Event()
    driver = None
    try:
        stack.start()
        # The loop is what the demo shows: traffic starts once the trainer consumes, so the
        # first versions count from the shift, not from the trainer's model load.
        print("[osd demo] waiting for the trainer's first heartbeat", flush=True)
        if not stack.wait_trainer(TRAINER_START_S):
            print(
                f"[osd demo] no trainer heartbeat in {TRAINER_START_S:.0f}s (see trainer.log); "
                "sending traffic anyway",
                flush=True,
            )
        wall_start = time.time()
        poller = threading.Thread(
            target=poll_health, args=(stack.base_url, health, events, stop), daemon=True
        )
        poller.start()
        keys = config.serve.api_keys
        driver = TrafficDriver(
            stack.base_url,
            items,
            config.serve.model_name,
            concurrency,
            reference_every,
            api_key=keys[0] if keys else None,
            labels=labels,
        )
        driver.start()
        view = functools.partial(live_view, driver, health, len(items))
        with Live(view(stack.supervision()), refresh_per_second=1) as live:
            while not driver.done:
                time.sleep(1.0)
                live.update(view(stack.supervision()))
        supervision = stack.supervision()
        published = _published_versions(stack.redis_url, config)
        routing = _routing_stats(stack.redis_url, config)
    finally:
        stop.set()
        if driver is not None:
            driver.stop()
        stack.close()
    return {
        "samples": driver.samples,
        "failures": driver.failures,
        "failure_reasons": driver.errors,
        "wall_start": wall_start,
        "events": sorted(events.values(), key=lambda e: e["time"]),
        "published": published,
        "routing": routing,
        "labels": labels,
        "run_dir": stack.run_dir,
        "loop": {"last_health": describe_loop(health, supervision), "restarts": supervision},
    }


def _published_versions(redis_url: str, config: OSDConfig) -> list[dict[str, Any]]:
    from osd.adapters import adapter_store_location, open_adapter_store
    from osd.versions.errors import VersionNotFound

    store = open_adapter_store(adapter_store_location(config, redis_url))
    out = []
    for name in config.model.adapters:
        for version in store.list_versions(name):
            try:
                manifest = store.manifest(name, version)
            except VersionNotFound:  # the trainer deleted it meanwhile (bounded history)
                continue
            out.append(
                {
                    "adapter": name,
                    "version": version,
                    "time": manifest.created_at,
                    "acceptance_estimate": manifest.acceptance_estimate,
                }
            )
    return sorted(out, key=lambda e: e["time"])


def _routing_stats(redis_url: str, config: OSDConfig) -> list[dict[str, Any]]:
    """The content router's accuracy points, oldest first ([]: none, or Redis is gone)."""
    from osd.routing.store import RoutingStats
    from osd.versions.errors import StoreError

    stats = RoutingStats(redis_url, config.log.stream)
    try:
        return stats.all()
    except (StoreError, ValueError):  # ValueError: a stats entry that is not JSON
        return []
    finally:
        stats.close()


def describe_routing(routing: dict[str, Any]) -> str:
    """One line on the content router's accuracy (report.json's ``routing``); "": no points."""
    if not routing["points"]:
        return ""

    def value(key: str) -> str:
        return "n/a" if routing[key] is None else format(routing[key], ".2f")

    return (
        f"  routing accuracy (served adapter = best per the logs): first {value('first')}, last "
        f"{value('last')} over {len(routing['points'])} points; router versions "
        f"{routing['published']}"
    )


def describe_reference(numbers: dict[str, Any]) -> str:
    """One line of a phase's speculative rate against its reference (report.json's numbers)."""

    def value(key: str, fmt: str) -> str:
        return "n/a" if numbers[key] is None else format(numbers[key], fmt)

    return (
        f"speculation off {value('reference', '.1f')} tok/s; speculative right after the shift "
        f"{value('first_vs_reference', '.2f')}x (k {value('mean_k_first', '.2f')}), at the end "
        f"{value('last_vs_reference', '.2f')}x (k {value('mean_k_last', '.2f')})"
    )


def _has_openai() -> bool:
    import importlib.util

    return importlib.util.find_spec("openai") is not None


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="osd demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", default="demo", help="a YAML file, or demo: the built-in local default"
    )
    parser.add_argument(
        "--schedule",
        default="prose:40,code:200,sql:200,mixed:80",
        help="domain:requests phases of the traffic (a phase: a domain, mixed, or chat: all "
        "chats on topics drawn at random)",
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reference-every",
        type=int,
        default=10,
        help="send one window of --concurrency requests in this many with speculation off, as "
        "the target-only reference (0: none)",
    )
    parser.add_argument(
        "--chat-share",
        type=float,
        default=0.2,
        help="share of each domain's requests (code, SQL, math, JSON) sent as a chat on it "
        "through /v1/chat/completions with the openai client (0: none)",
    )
    parser.add_argument(
        "--unlabeled",
        action="store_true",
        help="send the same workload without domain labels: the replica routes by prompt "
        'content (docs/trainer.md, "Content routing")',
    )
    parser.add_argument("--workload", help="a JSONL workload to replay instead of the demo's")
    parser.add_argument("overrides", nargs="*", help="config overrides like serve.port=9000")
    args = parser.parse_args(list(argv))
    if not 0.0 <= args.chat_share <= 1.0:
        parser.error(f"--chat-share must be in [0, 1], got {args.chat_share}")
    config = load_config(args.config, args.overrides)
    config.serve.check_access()  # before anything starts
    install_signal_handlers()
    try:
        if args.workload:
            from osd.demo import load_workload

            items = load_workload(args.workload)
        else:
            items = demo_workload(args.schedule, args.max_tokens, args.seed, args.chat_share)
        if any(getattr(i, "messages", None) is not None for i in items) and not _has_openai():
            print(
                "error: the chat requests are sent with the openai client: pip install openai "
                "(or --chat-share 0)",
                flush=True,
            )
            return 2
        moved = set_aside_previous_run(Path(config.run_dir))
        if moved is not None:
            print(
                f"[osd demo] the previous run's state is kept in {moved}; this run starts "
                "from the base draft",
                flush=True,
            )
        result = run(
            config, items, args.concurrency, args.reference_every, labels=not args.unlabeled
        )
    except KeyboardInterrupt:
        print("\ninterrupted: everything started was stopped.", flush=True)
        return 130
    report = write_report(result, Path(result["run_dir"]), config)
    print(f"report: {report['paths']}")
    print(result["loop"]["last_health"])
    for domain, numbers in report["domains"].items():
        print(
            f"  {domain:6s} low after shift {numbers['low']:.3f} -> last "
            f"{numbers['final']:.3f} (rise {numbers['rise']:+.3f})"
        )
    firsts = report["first_versions"]
    if firsts:
        print(
            "  first version of a domain's adapter, in that domain's requests since its shift: "
            + ", ".join(
                f"{d}{' (adapter ' + n['adapter'] + ')' if 'adapter' in n else ''} published "
                f"after {n['published_after']}, in service from request {n['served_after']}"
                if n["served_after"] is not None
                else f"{d} none in service"
                for d, n in firsts.items()
            )
        )
    if args.unlabeled:
        print("  the traffic carried no domain labels: the replica routed it by prompt content")
    if line := describe_routing(report["routing"]):
        print(line)
    chat = report["chat"]
    if chat["requests"]:
        print(
            f"  chat: {chat['requests']} requests through /v1/chat/completions, "
            f"{chat['empty_responses']} answered empty; acceptance by topic: "
            + ", ".join(f"{t} {n['final']:.3f}" for t, n in chat["by_topic"].items())
        )
        if chat["offered_tools"]:
            print(
                f"  tools: {chat['offered_tools']} chats offered tools (tool_choice auto), "
                f"{chat['called_tools']} answered with tool calls ({chat['tool_calls']} calls)"
            )
    print("decode tokens/s per request against the reference requests (speculation off):")
    for phase, numbers in report["reference"].items():
        print(f"  {phase:6s} {describe_reference(numbers)}")
    print("drafted by (share of drafted tokens, acceptance):")
    for scope, mix in report["proposers"].items():
        print(f"  {scope:6s} {describe_mix(mix)}")
    return 0
