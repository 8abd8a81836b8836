"""``osd demo``: the main job. The whole online loop on this machine, learning on its traffic.

Builds (or reuses) the demo models, starts the embedded stack (redis-server, local Ray, the
Serve app, the trainer), drives the demo workload through the real HTTP API while the domain mix
shifts, and shows acceptance per domain, tokens/s and adapter versions live. A share of the
requests (a window of ``concurrency`` consecutive ones in every ``reference_every``) is sent
with speculation off: their tokens/s is the target-only reference, measured in the same run,
that the speculative requests are compared with. A share of the requests (``--chat-share``) are
chats on their domain, sent through ``/v1/chat/completions`` with the official ``openai`` client
and reported as the ``chat`` domain (routed by their topic, so the domain's adapter serves and
learns from them). At the end it
writes ``report.json`` and ``report.png`` into the run directory, logs a W&B run (offline by
default) and stops everything it started, also on Ctrl-C. Every number comes from the running
system: responses' own speculative stats, the replica's adapter events, the store's versions.
"""

from __future__ import annotations

import argparse
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from osd.config import OSDConfig, load_config
from serving.demo_report import decode_rate, write_report
from serving.stack import LocalStack, install_signal_handlers

__all__ = ["Sample", "TrafficDriver", "main"]


@dataclass
class Sample:
    """One finished request as the client saw it."""

    time: float  # seconds since the traffic started
    domain: str
    phase: str
    acceptance: float
    tokens: int
    latency: float
    adapter: str
    version: int
    status: int
    drafted: int = 0  # drafted tokens (0: no measurement of acceptance)
    mean_k: float = 0.0  # tokens drafted per step, as the goodput controller chose them
    reference: bool = False  # sent with speculation off: the target-only reference
    decode_seconds: float = 0.0  # the replica's time from the first token to the last
    endpoint: str = "completions"  # or "chat": /v1/chat/completions (then domain is "chat")
    topic: str = ""  # the request's own domain, its route key (differs from domain for chats)
    text_chars: int = 0  # characters of the returned text (a chat answering "" shows here)


def is_reference(index: int, concurrency: int, every: int) -> bool:
    """Whether workload item ``index`` is sent with speculation off (0: never).

    Windows of ``concurrency`` consecutive items, one window in ``every``: the clients take
    items in order, so the requests of a window mostly run beside each other, and the replica
    serves them as a replica with speculation off would.
    """
    return every > 0 and (index // max(concurrency, 1)) % every == every - 1


class TrafficDriver:
    """Sends workload items in order from a few client threads; keeps every sample."""

    def __init__(
        self,
        base_url: str,
        items: list[Any],
        model: str,
        concurrency: int,
        reference_every: int = 10,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url
        self.url = f"{base_url}/v1/completions"
        self.api_key = api_key
        self.items, self.model, self.concurrency = items, model, concurrency
        self.reference_every = reference_every
        self.samples: list[Sample] = []
        self.failures = 0
        self.errors: list[str] = []  # the first few failures, for the report
        self.start_time = time.monotonic()
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._worker, daemon=True) for _ in range(concurrency)
        ]

    def start(self) -> None:
        self.start_time = time.monotonic()
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def done(self) -> bool:
        return not any(t.is_alive() for t in self._threads)

    def _take(self) -> tuple[int, Any] | None:
        with self._lock:
            if self._next >= len(self.items) or self._stop.is_set():
                return None
            self._next += 1
            return self._next - 1, self.items[self._next - 1]

    def _worker(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        chat: Any = None  # the openai client, made on this thread's first chat
        with httpx.Client(timeout=300, headers=headers) as client:
            try:
                while (taken := self._take()) is not None:
                    index, item = taken
                    reference = is_reference(index, self.concurrency, self.reference_every)
                    if getattr(item, "messages", None) is None:
                        self._send(client, item, reference)
                        continue
                    if chat is None:
                        import openai

                        # No retries: a failure is counted, as on the completions path.
                        chat = openai.OpenAI(
                            base_url=f"{self.base_url}/v1",
                            api_key=self.api_key or "unused",
                            max_retries=0,
                            timeout=300,
                        )
                    self._send_chat(chat, item, reference)
            finally:
                if chat is not None:
                    chat.close()

    def _send_chat(self, client: Any, item: Any, reference: bool) -> None:
        """One chat through the official client; the osd stats are the response's extra
        field ``osd``, the domain and speculation settings go in the request's extra body."""
        import openai

        extra: dict[str, Any] = {"domain": item.domain}
        if reference:
            extra["spec"] = {"method": "none"}
        options: dict[str, Any] = {} if item.seed is None else {"seed": item.seed}
        start = time.monotonic()
        try:
            completion = client.chat.completions.create(
                model=self.model,
                messages=item.messages,
                max_completion_tokens=item.max_tokens,
                temperature=0.0 if item.temperature is None else item.temperature,
                extra_body=extra,
                **options,
            )
        except openai.APIStatusError as e:
            self._failed(f"chat request {item.id}: HTTP {e.status_code}: {str(e)[:300]}")
            return
        except openai.APIError as e:
            self._failed(f"chat request {item.id}: {type(e).__name__}: {e}")
            return
        stats = (completion.model_extra or {}).get("osd")
        if not isinstance(stats, dict) or completion.usage is None:
            self._failed(f"chat request {item.id}: no osd stats or usage in the response")
            return
        text = completion.choices[0].message.content or ""
        self._record(
            item, stats, completion.usage.completion_tokens, text, start, reference, "chat"
        )

    def _record(
        self,
        item: Any,
        stats: dict[str, Any],
        tokens: int,
        text: str,
        start: float,
        reference: bool,
        endpoint: str,
    ) -> None:
        sample = Sample(
            time=time.monotonic() - self.start_time,
            domain="chat" if endpoint == "chat" else item.domain,
            phase=item.phase or item.domain,
            acceptance=stats["acceptance_rate"],
            tokens=tokens,
            latency=time.monotonic() - start,
            adapter=stats["adapter"],
            version=stats["adapter_version"],
            status=200,
            drafted=stats["drafted"],
            mean_k=stats["mean_draft_length"],
            decode_seconds=stats["decode_seconds"],
            reference=reference,
            endpoint=endpoint,
            topic=item.domain,
            text_chars=len(text),
        )
        with self._lock:
            self.samples.append(sample)

    def _send(self, client: httpx.Client, item: Any, reference: bool) -> None:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": item.prompt,
            "max_tokens": item.max_tokens,
            "temperature": 0.0 if item.temperature is None else item.temperature,
            "domain": item.domain,
        }
        if item.seed is not None:
            body["seed"] = item.seed
        if reference:
            body["spec"] = {"method": "none"}
        start = time.monotonic()
        try:
            response = client.post(self.url, json=body)
            data = response.json()
        except (httpx.HTTPError, ValueError) as e:
            self._failed(f"request {item.id}: {type(e).__name__}: {e}")
            return
        if response.status_code != 200:
            self._failed(f"request {item.id}: HTTP {response.status_code}: {response.text[:300]}")
            return
        text = data["choices"][0]["text"]
        tokens = data["usage"]["completion_tokens"]
        self._record(item, data["osd"], tokens, text, start, reference, "completions")

    def _failed(self, reason: str) -> None:
        with self._lock:
            self.failures += 1
            if len(self.errors) < 20:
                self.errors.append(reason)


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


def describe_chat(samples: list[Sample]) -> str:
    """One line on the chats (/v1/chat/completions) so far, ending in a newline; "" if none."""
    chats = [s for s in samples if s.endpoint == "chat"]
    if not chats:
        return ""
    empty = sum(s.text_chars == 0 for s in chats)
    topics = ", ".join(
        f"{t} {sum(s.topic == t for s in chats)}" for t in sorted({s.topic for s in chats})
    )
    return f"chat (/v1/chat/completions, openai client): {len(chats)} ({topics}), {empty} empty\n"


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
    table.add_column("requests", justify="right")
    for domain, numbers in recent_by_domain(samples).items():
        table.add_row(
            domain,
            f"{numbers['acceptance']:.3f}",
            f"{numbers['mean_k']:.2f}",
            str(int(numbers["requests"])),
        )
    # The last 40 of each kind: decode tokens/s, speculation on against off.
    spec = decode_rate([s for s in samples if not s.reference][-40:]) or float("nan")
    alone = decode_rate([s for s in samples if s.reference][-40:]) or float("nan")
    versions = ", ".join(f"{a} v{v}" for a, v in health.get("adapters", {}).items())
    table.caption = (
        f"decoding: {spec:.1f} tok/s per request speculative, {alone:.1f} with speculation off "
        f"(reference requests): {spec / alone:.2f}x\nadapters in service: {versions}\n"
        + describe_chat(samples)
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


def run(
    config: OSDConfig, items: list[Any], concurrency: int, reference_every: int = 10
) -> dict[str, Any]:
    """Runs the stack and the traffic; returns what the report needs."""
    from rich.live import Live

    stack = LocalStack(config)
    health: dict[str, Any] = {}
    events: dict[tuple, dict] = {}
    stop = threading.Event()
    driver = None
    try:
        stack.start()
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
        )
        driver.start()
        view = functools.partial(live_view, driver, health, len(items))
        with Live(view(stack.supervision()), refresh_per_second=1) as live:
            while not driver.done:
                time.sleep(1.0)
                live.update(view(stack.supervision()))
        supervision = stack.supervision()
        published = _published_versions(stack.redis_url, config)
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
        "run_dir": stack.run_dir,
        "loop": {"last_health": describe_loop(health, supervision), "restarts": supervision},
    }


def _published_versions(redis_url: str, config: OSDConfig) -> list[dict[str, Any]]:
    from osd.adapter_store import AdapterNotFound, adapter_store_location, open_adapter_store

    store = open_adapter_store(adapter_store_location(config, redis_url))
    out = []
    for name in config.model.adapters:
        for version in store.list_versions(name):
            try:
                manifest = store.manifest(name, version)
            except AdapterNotFound:  # the trainer deleted it meanwhile (bounded history)
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
        result = run(config, items, args.concurrency, args.reference_every)
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
    chat = report["chat"]
    if chat["requests"]:
        print(
            f"  chat: {chat['requests']} requests through /v1/chat/completions, "
            f"{chat['empty_responses']} answered empty; acceptance by topic: "
            + ", ".join(f"{t} {n['final']:.3f}" for t, n in chat["by_topic"].items())
        )
    print("decode tokens/s per request against the reference requests (speculation off):")
    for phase, numbers in report["reference"].items():
        print(f"  {phase:6s} {describe_reference(numbers)}")
    return 0
