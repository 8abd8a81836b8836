"""CPU threads and OpenMP's wait policy, alone and beside a busy process: a training step of
the demo target (what the demo build spends its time on) and a batched decode step of it (what a
replica does).

    python -m bench.bench_threads              # step times, a few minutes on 2 cores
    python -m bench.bench_threads --build      # also whole forced builds (~45 min on 2 cores)
    python -m bench.bench_threads --scale tiny --steps 2 --warmup 1   # smoke run, seconds

Run it on a machine with nothing else running: it starts the one busy process itself (a child
doing 512 x 512 matmuls in a loop with torch's default threads and wait policy). Each
configuration runs in a fresh process, since OpenMP reads the wait policy when torch loads:
2 threads (torch's default on 2 cores), 2 threads with ``OMP_WAIT_POLICY=PASSIVE``, 1 thread,
and the build's own choice: every usable core, tuned by :class:`osd.threads.ThreadTuner`
between that and 1 thread by measured step times (probing every 6 steps here, every 64 in the
build). Training steps are averaged (a tuner's probes cost time too), decode steps are medians.

Prints a table (ms) and, with ``--build``, build seconds; ``--json`` saves them.

``--react``: how fast the build's tuner (probing every 64 steps, as in the build) leaves 2
threads when a busy neighbour starts mid-run: training steps of the demo target, the neighbour
started after ``--neighbour-at`` steps, with the tuner reacting to a change of step time (the
default) and without (``react_factor`` infinite: the scheduled probes only); each step's
seconds and thread count, and the ETA a build of 800 steps would show (the mean of the last 8
steps times the steps left).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from bench.tables import print_table

# How each configuration sets threads (the child applies it) and the environment it runs in.
CONFIGS: dict[str, dict[str, str]] = {
    "2 threads": {"OSD_TORCH_THREADS": "2"},
    "2 threads, PASSIVE": {"OSD_TORCH_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OSD_TORCH_THREADS": "1"},
    "tuned (osd.threads)": {},
}
PROBE_EVERY = 6  # the tuner's probe interval here (the build's is 64: a build has thousands)
SITUATIONS = ("alone", "beside a busy process")
_OURS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OSD_TORCH_THREADS", "OSD_TORCH_PROCESSES")
_BUSY = (
    "import torch\n"
    "a = torch.randn(512, 512)\n"
    "a @ a\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    a @ a\n"
)


def _env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without any thread settings, plus ``extra``."""
    return {k: v for k, v in os.environ.items() if k not in _OURS} | extra


def _start_busy() -> subprocess.Popen[str]:
    busy = subprocess.Popen(
        [sys.executable, "-c", _BUSY], env=_env({}), stdout=subprocess.PIPE, text=True
    )
    assert busy.stdout is not None
    busy.stdout.readline()  # computing from here on
    return busy


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _child(config: str, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.bench_threads", "--child", mode, "--config", config]
    command += ["--scale", args.scale, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    done = subprocess.run(
        command, env=_env(CONFIGS[config]), capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise RuntimeError(f"{config} ({mode}) failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _median_ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds)


class _TunedTraining:
    """Training steps of the scale's target (random tokens: a step's time does not depend on
    them) under the build's thread tuner, made with ``tuner_options``."""

    def __init__(self, scale: str, **tuner_options: Any) -> None:
        import torch

        from osd.demo.recipe import recipe_for
        from osd.demo.training import new_model, new_optimizer
        from osd.threads import ThreadTuner, apply_threads

        self.recipe = recipe_for(scale)
        self.threads = apply_threads("build").num_threads
        self.tuner = ThreadTuner(
            (self.threads, 1), set_threads=torch.set_num_threads, **tuner_options
        )
        vocab = self.recipe.tokenizer.vocab_size
        self.model = new_model(self.recipe.target, vocab, {"bos": 1, "eos": 0, "pad": 2}, seed=0)
        self.train = self.recipe.target_train
        self.optimizer = new_optimizer(self.model, self.train)
        gen = torch.Generator().manual_seed(0)
        shape = (self.train.batch_size, self.train.seq_len + 1)
        self.batch = torch.randint(3, vocab, shape, generator=gen)

    def step(self, index: int) -> tuple[float, int]:
        """One tuned training step: (seconds, threads it ran on)."""
        from osd.demo.training import train_step

        self.tuner.before_step()
        threads = self.tuner.threads
        started = time.perf_counter()
        train_step(self.model, self.optimizer, self.batch, self.train, index)
        seconds = time.perf_counter() - started
        self.tuner.after_step(seconds)
        return seconds, threads


def _steps_child(config: str, scale: str, steps: int, warmup: int) -> dict[str, Any]:
    """Times training and decode steps of the scale's target in this process."""
    import torch

    run = _TunedTraining(scale, probe_every=PROBE_EVERY)
    timed = [run.step(step) for step in range(warmup + steps)]
    train_s, used = [t for t, _ in timed], [n for _, n in timed]
    model, train, threads = run.model, run.train, run.threads
    model.eval()
    torch.set_num_threads(threads)
    decode_s = []
    with torch.inference_mode():
        prompt = run.batch[:, : min(64, train.seq_len)]  # (B, P): 8 rows at full scale
        out = model(input_ids=prompt, use_cache=True)
        cache, next_ids = out.past_key_values, out.logits[:, -1:].argmax(-1)  # (B, 1)
        room = run.recipe.target.max_positions - prompt.shape[1] - warmup
        for _ in range(warmup + min(4 * steps, room)):
            started = time.perf_counter()
            out = model(input_ids=next_ids, past_key_values=cache, use_cache=True)
            cache, next_ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
            decode_s.append(time.perf_counter() - started)
    return {
        "threads": threads,
        "threads_used": used[warmup:],
        "wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "train_ms": 1000 * statistics.mean(train_s[warmup:]),  # the mean: probes cost too
        "decode_ms": _median_ms(decode_s[warmup:]),
    }


def _react_child(scale: str, steps: int, neighbour_at: int, react: bool) -> dict[str, Any]:
    """Training steps with the build's tuner; a busy neighbour starts after ``neighbour_at``."""
    run = _TunedTraining(scale, react_factor=2.0 if react else float("inf"))
    timed: list[tuple[float, int]] = []
    busy = None
    try:
        for step in range(steps):
            if step == neighbour_at:
                busy = _start_busy()
            timed.append(run.step(step))
    finally:
        if busy is not None:
            _stop(busy)
    seconds = [t for t, _ in timed]
    eta = [statistics.mean(seconds[max(0, i - 7) : i + 1]) * (800 - i - 1) for i in range(steps)]
    return {"seconds": seconds, "threads": [n for _, n in timed], "eta_800": eta}


def _react(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for react in (False, True):
        command = [sys.executable, "-m", "bench.bench_threads", "--child", "react"]
        command += ["--scale", args.scale, "--steps", str(args.steps)]
        command += ["--neighbour-at", str(args.neighbour_at)] + (["--react"] if react else [])
        done = subprocess.run(command, env=_env({}), capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"react={react} failed:\n{done.stderr[-3000:]}")
        out["reacting" if react else "scheduled probes only"] = json.loads(
            done.stdout.strip().splitlines()[-1]
        )
    at = args.neighbour_at
    rows = []
    for name, run in out.items():
        seconds, used, eta = run["seconds"], run["threads"], run["eta_800"]
        after = list(range(at, len(seconds)))
        switched = next((i for i in after if used[i] == 1), None)
        rows.append(
            [
                name,
                f"{statistics.mean(seconds[1:at]):.2f}",
                f"{eta[at - 1] / 60:.1f}",
                "never"
                if switched is None
                else f"{switched - at} steps, {sum(seconds[at:switched]):.1f} s",
                f"{max(eta[at:]) / 60:.1f}",
                f"{statistics.mean(seconds[-8:]):.2f}",
                f"{eta[-1] / 60:.1f}",
            ]
        )
    print_table(
        f"demo target training steps, a busy torch process from step {at} on",
        [
            "tuner",
            "step alone (s)",
            "ETA before (min)",
            "to 1 thread",
            "worst ETA (min)",
            "step at the end (s)",
            "ETA at the end (min)",
        ],
        rows,
    )
    return out


def _build_child(config: str, scale: str) -> dict[str, Any]:
    """Times a whole forced build (every stage) into a temporary cache."""

    from osd.demo import build_demo_models

    threads = int(os.environ.get("OSD_TORCH_THREADS", "0")) or None
    with tempfile.TemporaryDirectory() as cache:
        started = time.perf_counter()
        build_demo_models(cache, scale, progress=False, force=True, num_threads=threads)
        return {"build_s": time.perf_counter() - started}


def _measure(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    results: dict[str, dict[str, dict[str, Any]]] = {s: {} for s in SITUATIONS}
    for situation in SITUATIONS:
        busy = _start_busy() if situation != "alone" else None
        try:
            for config in CONFIGS:
                row = _child(config, args, "steps")
                if args.build:
                    row |= _child(config, args, "build")
                results[situation][config] = row
                print(json.dumps({"situation": situation, "config": config, **row}), flush=True)
        finally:
            if busy is not None:
                _stop(busy)
    return results


def _print(results: dict[str, dict[str, dict[str, Any]]], build: bool) -> None:
    alone, busy = (results[s] for s in SITUATIONS)
    header = ["config", "threads", "OMP_WAIT_POLICY", "train alone", "train busy", "decode alone"]
    header += ["decode busy"] + (["build alone (s)", "build busy (s)"] if build else [])
    rows = []
    for config in CONFIGS:
        row = [config, alone[config]["threads"], alone[config]["wait_policy"]]
        row += [f"{r[config][key]:.1f}" for key in ("train_ms", "decode_ms") for r in (alone, busy)]
        row += [f"{r[config]['build_s']:.0f}" for r in (alone, busy)] if build else []
        rows.append(row)
    title = "demo target: training step (mean ms), decode step (median ms); busy: beside one busy"
    print_table(title + " torch process", header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scale", choices=["tiny", "full"], default="full")
    parser.add_argument("--steps", type=int, default=24, help="timed training steps (mean)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--build", action="store_true", help="also time whole forced builds")
    parser.add_argument("--json", default="", help="also write the results to this file")
    parser.add_argument("--react", action="store_true", help="the tuner beside a neighbour")
    parser.add_argument("--neighbour-at", type=int, default=8, help="--react: its start step")
    parser.add_argument("--child", choices=["steps", "build", "react"], help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "steps":
        print(json.dumps(_steps_child(args.config, args.scale, args.steps, args.warmup)))
        return 0
    if args.child == "build":
        print(json.dumps(_build_child(args.config, args.scale)))
        return 0
    if args.child == "react":
        print(json.dumps(_react_child(args.scale, args.steps, args.neighbour_at, args.react)))
        return 0
    if args.react:
        results = _react(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    print(f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable", flush=True)
    results = _measure(args)
    _print(results, args.build)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
