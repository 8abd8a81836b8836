"""Benchmark of the online distillation trainer: throughput, positions, record-to-version latency.

Run from the repository root::

    python -m bench.bench_trainer [--records 256] [--steps 150] [--seeds 3] [--duration 20]
                                  [--rate 20] [--no-demo]

For each pair (the toy pair of the tests: a tiny random Llama target and a noisy copy as draft;
and the offline demo pair when `osd.model_sources.find_demo_models()` finds it built) it logs
records of
real speculative generations, then prints:

1. training throughput: input tokens per second through forward + backward of one LoRA step,
   against the peer of a plain forward (no grad) over the same batches, measured in the same run;
2. held-out acceptance (mean lower bound) of the base draft and after `--steps` steps when
   training on every generated position vs on rejected positions only (same records, same seeds);
3. record-to-version latency: a producer thread logs records at `--rate` per second into a
   private redis-server while a `TrainerWorker` runs; for each record, the seconds from its
   arrival in the stream to the publication of the first version trained on it.

There is no pass or fail; numbers depend on the machine (CPU here unless CUDA is present).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.cpu import add_threads_argument, apply_bench_threads
from osd import SpeculativeDecoder
from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis
from osd.buffer.writer import LogWriter
from osd.config import load_config, resolve_device
from osd.testing import noisy_copy, tiny_llama
from trainer.draft_trainer import DraftTrainer
from trainer.examples import collate, is_held_out
from trainer.wiring import wire_trainer
from trainer.worker import TrainerWorker

_DEMO_PROMPTS = [
    "The history of the city",
    "def parse_config(path):",
    "SELECT name, count(*) FROM",
    "Tom has 3 apples and buys 4 more. How many",
    '{"id": 17, "name":',
]


class Pair:
    """A target/draft pair, rebuilt on demand (peft wraps the draft in place)."""

    def __init__(self, name: str, make_target: Any, make_draft: Any, tokenizer: Any) -> None:
        self.name, self.make_target, self.make_draft = name, make_target, make_draft
        self.tokenizer = tokenizer

    def prompts(self, n: int, rng: np.random.Generator, vocab_size: int) -> list[Any]:
        if self.tokenizer is not None:
            return [_DEMO_PROMPTS[i % len(_DEMO_PROMPTS)] for i in range(n)]
        return [
            rng.integers(2, vocab_size, size=int(rng.integers(3, 12))).tolist() for _ in range(n)
        ]


def toy_pair() -> Pair:
    def target() -> Any:
        return tiny_llama(vocab_size=64, hidden_size=64, num_layers=2, seed=0, logit_scale=4.0)

    return Pair(
        "toy (tiny Llama, draft = noisy copy 0.5)",
        target,
        lambda: noisy_copy(target(), 0.5, 1),
        None,
    )


def demo_pair() -> Pair | None:
    """The demo pair if it is built already (never builds it here)."""
    try:
        from osd.model_sources import find_demo_models
    except ImportError:
        return None
    paths = find_demo_models()
    if paths is None:
        return None
    from transformers import AutoModelForCausalLM

    from osd.decode.models import load_tokenizer

    def load(path: Path) -> Any:
        return AutoModelForCausalLM.from_pretrained(path).float().eval()

    return Pair(
        f"demo ({paths.root})", lambda: load(paths.target), lambda: load(paths.draft),
        load_tokenizer(str(paths.target)),
    )  # fmt: skip


def make_records(pair: Pair, num_records: int, seed: int = 0) -> list[Record]:
    """Records of speculative generations (block verification, temperature 1, top-32)."""
    engine = SpeculativeDecoder(pair.make_target(), pair.make_draft(), pair.tokenizer)
    rng = np.random.default_rng(seed)
    records = []
    started = time.perf_counter()
    for i, prompt in enumerate(pair.prompts(num_records, rng, engine.vocab_size)):
        result = engine.generate(prompt, max_tokens=32, temperature=1.0, seed=seed + i)
        assert result.log is not None
        records.append(Record.from_generation(result.log, request_id=f"bench-{seed}-{i}"))
    seconds = time.perf_counter() - started
    print(f"  logged {num_records} records in {seconds:.1f} s (generation, not the trainer)")
    return records


def new_trainer(pair: Pair, learning_rate: float = 3e-3) -> DraftTrainer:
    config = load_config(None, ["model.target=toy:target", "model.draft=toy:draft"])
    return DraftTrainer(
        pair.make_draft(),
        config.model,
        ["general"],
        base_model_id=pair.name,
        learning_rate=learning_rate,
        device=resolve_device("auto"),
    )


def bench_throughput(pair: Pair, records: Sequence[Record], steps: int) -> None:
    trainer = new_trainer(pair)
    batches = [list(records[i : i + 16]) for i in range(0, len(records) - 15, 16)]
    trainer.train_step("general", batches[0], "all")  # warm-up
    tokens, started = 0, time.perf_counter()
    for i in range(steps):
        tokens += trainer.train_step("general", batches[i % len(batches)], "all").num_tokens
    train_s = time.perf_counter() - started
    forward_tokens, started = 0, time.perf_counter()
    with torch.no_grad():
        for i in range(steps):
            batch = collate(batches[i % len(batches)], "all").to(trainer.device)
            trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            forward_tokens += batch.num_tokens
    forward_s = time.perf_counter() - started
    train_rate, forward_rate = tokens / train_s, forward_tokens / forward_s
    print(
        f"  throughput ({trainer.device}, batch 16 records): training {train_rate:,.0f} tokens/s "
        f"({steps / train_s:.1f} steps/s); peer plain forward {forward_rate:,.0f} tokens/s; "
        f"a training step costs {forward_rate / train_rate:.1f}x a forward"
    )


def bench_positions(pair: Pair, records: Sequence[Record], steps: int, seeds: int) -> None:
    holdout = [r for r in records if is_held_out(r.request_id, 0.25)]
    train = [r for r in records if not is_held_out(r.request_id, 0.25)]
    base = new_trainer(pair).estimate("general", "current", holdout).lower
    results: dict[str, list[float]] = {"all": [], "rejected": []}
    for mode, scores in results.items():
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            trainer = new_trainer(pair)
            for _ in range(steps):
                picks = rng.choice(len(train), size=16, replace=False)
                trainer.train_step("general", [train[i] for i in picks], mode)  # type: ignore[arg-type]
            scores.append(trainer.estimate("general", "candidate", holdout).lower)
    print(f"  held-out acceptance ({len(holdout)} records): base draft {base:.4f}")
    for mode, scores in results.items():
        spread = statistics.pstdev(scores) if len(scores) > 1 else 0.0
        print(
            f"    positions={mode:<8} after {steps} steps: {statistics.fmean(scores):.4f} "
            f"+- {spread:.4f} over {seeds} seeds (gain {statistics.fmean(scores) - base:+.4f})"
        )


def bench_latency(pair: Pair, records: Sequence[Record], duration_s: float, rate: float) -> None:
    with LocalRedis() as server, tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            None,
            [
                "model.target=toy:target", "model.draft=toy:draft", "wandb.mode=disabled",
                "adapters.store=directory", f"adapters.root={tmp}/adapters", f"run_dir={tmp}",
                "trainer.batch_records=16", "trainer.steps_per_round=10",
                "trainer.min_records=16", "trainer.max_record_wait_s=1.0",
                "trainer.learning_rate=0.003", "trainer.holdout_fraction=0.2",
                "trainer.publish_margin=0.0", "trainer.min_holdout_records=8",
            ],
        )  # fmt: skip
        worker = wire_trainer(config, server.url, draft=pair.make_draft(), base_model_id=pair.name)
        stop = threading.Event()
        writer = LogWriter(server.url, config.log.stream)

        def produce() -> None:
            for i in range(int(duration_s * rate)):
                if stop.wait(1.0 / rate):
                    return
                writer.log(records[i % len(records)])

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        _run_for(worker, duration_s + 3.0)
        stop.set()
        producer.join()
        writer.close()
        worker.close()
    stats = worker.stats.as_dict()
    latency = stats.get("record_to_version_s")
    if not latency:
        print(f"  latency: no version published in {duration_s:.0f} s ({stats})")
        return
    print(
        f"  record -> version at {rate:g} records/s for {duration_s:.0f} s: p50 "
        f"{latency['p50']:.2f} s, mean {latency['mean']:.2f} s, max {latency['max']:.2f} s; "
        f"{stats['published']} versions published, {stats['refused']} refused, "
        f"{stats['trained_records']} records trained, {stats['held_out']} judged first"
    )


def _run_for(worker: TrainerWorker, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        worker.run_once(block_ms=200)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_trainer", description=__doc__)
    parser.add_argument("--records", type=int, default=256, help="records to log per pair")
    parser.add_argument("--steps", type=int, default=150, help="training steps per measurement")
    parser.add_argument("--seeds", type=int, default=3, help="seeds for the positions comparison")
    parser.add_argument("--duration", type=float, default=20.0, help="latency run, seconds")
    parser.add_argument("--rate", type=float, default=20.0, help="records per second logged")
    parser.add_argument("--no-demo", action="store_true", help="skip the demo pair")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    apply_bench_threads(args.threads)
    torch.manual_seed(0)
    pairs = [toy_pair()]
    demo = None if args.no_demo else demo_pair()
    if demo is not None:
        pairs.append(demo)
    elif not args.no_demo:
        print("(demo pair not built or osd.model_sources.find_demo_models: toy pair only)")
    for pair in pairs:
        print(f"\npair: {pair.name}")
        records = make_records(pair, args.records)
        bench_throughput(pair, records, args.steps)
        bench_positions(pair, records, args.steps, args.seeds)
        bench_latency(pair, records, args.duration, args.rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
