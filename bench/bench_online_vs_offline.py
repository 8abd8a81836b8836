"""Online distillation against offline distillation on the same records (demo pair, one domain).

Run from the repository root (needs the demo pair: ``osd demo-models build``)::

    python -m bench.bench_online_vs_offline [--domain sql] [--records 240] [--chunk 40]

1. Logs ``--records`` records of real requests on the domain's *training* prompts: the engine with
   the base draft, greedy, as the demo's traffic is; each record carries the target's top-m
   distribution at every generated position, exactly what a replica logs.
2. **Online**: the real ``TrainerWorker`` (the demo config's trainer settings, a private
   redis-server, a directory adapter store) reads them from the stream ``--chunk`` at a time and
   trains, judges and publishes as it does in the demo. After each chunk, the *published* version
   of the domain's adapter (and of the general adapter) is measured.
3. **Offline**: a fresh LoRA adapter of the same layout trained on all the logged records (the
   online worker trains on all but its newest judge window: each record judges, then trains) for
   ``--offline-epochs`` passes (default 40: several times the steps the online trainer took):
   what distillation on these records reaches when compute is no object.

Measured twice on the domain's *held-out* prompts (never in a training record): the judge's
estimate (mean over generated positions of sum min(p, q), on records logged for those prompts)
and the acceptance rate the engine measures when it decodes them (block verification, k = 4,
greedy). Prints the curve and the ratio (online gain) / (offline gain). Also measures the
general adapter on prose held-out prompts, before and after, to show whether it forgot prose.
There is no pass or fail.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from osd import SpeculativeDecoder
from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis
from osd.buffer.writer import LogWriter
from osd.config import OSDConfig, load_config
from osd.demo import build_demo_models, load_corpus_split
from osd.demo.evaluation import measure_acceptance
from osd.demo.report import load_pair
from trainer.draft_trainer import DraftTrainer, build_draft_trainer, peft_name
from trainer.wiring import wire_trainer
from trainer.worker import TrainerWorker

_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def online_config(tmp: str, *overrides: str) -> OSDConfig:
    """The demo config for a trainer of its own under `tmp`: a directory adapter store, no W&B,
    rounds that start after half a second of waiting."""
    return load_config(
        _CONFIG,
        [
            "wandb.mode=disabled", "adapters.store=directory",
            f"adapters.root={tmp}/adapters", f"run_dir={tmp}",
            "trainer.max_record_wait_s=0.5", *overrides,
        ],
    )  # fmt: skip


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """``--out`` (results as JSON) and ``--cache`` (logged records kept for reruns)."""
    parser.add_argument("--out", default="", help="write the results as JSON here")
    parser.add_argument(
        "--cache", default="runs/bench/records", help="logged records kept here for reruns ('')"
    )


def demo_setup(args: argparse.Namespace, log_level: int) -> tuple[Any, Path | None, Any, Any, Any]:
    """Seeds torch, sets up logging, builds (or finds) the demo pair and loads it: `(paths,
    records cache folder or None, target, base draft, tokenizer)`."""
    torch.manual_seed(0)
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s: %(message)s")
    paths = build_demo_models()
    cache = Path(args.cache) / paths.root.name if args.cache else None
    return (paths, cache, *load_pair(paths))


def _prompts(paths: Any, domain: str, split: str) -> list[str]:
    return [doc.text[: doc.prompt_chars] for doc in load_corpus_split(paths.corpus, domain, split)]


def log_records(
    engine: SpeculativeDecoder,
    prompts: Sequence[str],
    domain: str,
    max_tokens: int,
    tag: str,
    cache: Path | None = None,
) -> list[Record]:
    """One record per prompt, from real greedy generations with the base draft.

    With `cache`, records are kept in ``<cache>/<tag>-<domain>-<n>-<max_tokens>.bin`` (the
    records' own binary format, length-prefixed) and read back instead of generated again.
    """
    path = cache / f"{tag}-{domain}-{len(prompts)}-{max_tokens}.bin" if cache else None
    if path is not None and path.is_file():
        data, records, offset = path.read_bytes(), [], 0
        while offset < len(data):
            size = int.from_bytes(data[offset : offset + 4], "little")
            records.append(Record.unpack(data[offset + 4 : offset + 4 + size]))
            offset += 4 + size
        return records
    records = []
    for i, prompt in enumerate(prompts):
        result = engine.generate(prompt, max_tokens=max_tokens, temperature=0.0, seed=i)
        assert result.log is not None
        records.append(Record.from_generation(result.log, request_id=f"{tag}-{i}", domain=domain))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        packed = [r.pack() for r in records]
        path.write_bytes(b"".join(len(p).to_bytes(4, "little") + p for p in packed))
    return records


class Meter:
    """Measures one adapter slot of a peft draft: judge estimate and engine acceptance."""

    def __init__(
        self, target: Any, tokenizer: Any, eval_records: Sequence[Record], prompts: Sequence[str]
    ) -> None:
        self.target, self.tokenizer = target, tokenizer
        self.eval_records, self.prompts = list(eval_records), list(prompts)

    def __call__(
        self, trainer: DraftTrainer, adapter: str, slot: str, max_tokens: int
    ) -> dict[str, float]:
        estimate = trainer.estimate(adapter, slot, self.eval_records).lower  # type: ignore[arg-type]
        engine = SpeculativeDecoder(self.target, trainer.model, self.tokenizer)
        measured = measure_acceptance(
            engine,
            self.prompts,
            temperature=0.0,
            max_tokens=max_tokens,
            adapter=peft_name(adapter, slot),  # type: ignore[arg-type]
        )
        return {
            "estimate": round(estimate, 4),
            "measured": round(measured.acceptance_rate, 4),
            "tokens_per_step": round(measured.tokens_per_step, 3),
        }


def drain(worker: TrainerWorker, logged: int, timeout_s: float = 600.0) -> None:
    """Runs the worker until every logged record is consumed and no adapter waits for a round."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        worker.run_once(block_ms=100)
        if worker.stats.read >= logged and not any(d.fresh for d in worker.data.values()):
            return
    raise TimeoutError(f"worker did not drain {logged} records in {timeout_s:.0f} s")


def run_online(
    args: argparse.Namespace,
    draft: Any,
    records: Sequence[Record],
    meter: Meter,
    prose_meter: Meter,
    prose_records: Sequence[Record] = (),
) -> list[dict[str, Any]]:
    curve = []
    with LocalRedis() as server, tempfile.TemporaryDirectory() as tmp:
        holdout = [f"trainer.holdout_fraction={args.holdout}"] if args.holdout else []
        config = online_config(tmp, *holdout)
        worker = wire_trainer(config, server.url, draft=draft, base_model_id="demo:draft")
        writer = LogWriter(server.url, config.log.stream)
        base = {
            "records": 0,
            "domain": meter(worker.trainer, args.domain, "current", args.max_tokens),
            "general_on_prose": prose_meter(worker.trainer, "general", "current", args.max_tokens),
        }
        curve.append(base)
        print(f"  online   0 records: {base}", flush=True)
        if prose_records:  # the general adapter learns prose first, as in the demo
            for record in prose_records:
                writer.log(record)
            writer.flush()
            drain(worker, len(prose_records))
            base = {
                "records": 0,
                "after_prose_records": len(prose_records),
                "domain": meter(worker.trainer, args.domain, "current", args.max_tokens),
                "general_on_prose": prose_meter(
                    worker.trainer, "general", "current", args.max_tokens
                ),
            }
            curve.append(base)
            print(f"  online after {len(prose_records)} prose records: {base}", flush=True)
        started = time.perf_counter()
        logged = len(prose_records)
        for end in range(args.chunk, len(records) + 1, args.chunk):
            for record in records[end - args.chunk : end]:
                writer.log(record)
            writer.flush()
            drain(worker, logged + end)
            stats = worker.stats.as_dict()
            point = {
                "records": end,
                "train_seconds": round(time.perf_counter() - started, 1),
                "versions": {a: worker.store.current(a) for a in (args.domain, "general")},
                "published": stats["published"],
                "refused": stats["refused"],
                "domain": meter(worker.trainer, args.domain, "current", args.max_tokens),
                "general_on_domain": meter(worker.trainer, "general", "current", args.max_tokens),
                "general_on_prose": prose_meter(
                    worker.trainer, "general", "current", args.max_tokens
                ),
            }
            curve.append(point)
            print(f"  online {end:3d} records: {point}", flush=True)
            started = time.perf_counter() - point["train_seconds"]
        writer.close()
        worker.close()
    return curve


def run_offline(
    args: argparse.Namespace, draft: Any, records: Sequence[Record], meter: Meter
) -> dict[str, Any]:
    """Same LoRA layout and learning rate, all the records (a few more than online trained
    on), many passes."""
    config = load_config(_CONFIG, ["wandb.mode=disabled"])
    # Built as the online worker builds its own: same loss, learning rate, device and seed.
    trainer = build_draft_trainer(config, [args.domain], draft, base_model_id="demo:draft")
    rng = np.random.default_rng(0)
    batch = config.trainer.batch_records
    steps = args.offline_epochs * max(1, len(records) // batch)
    started = time.perf_counter()
    for _ in range(steps):
        picks = rng.choice(len(records), size=min(batch, len(records)), replace=False)
        trainer.train_step(args.domain, [records[i] for i in picks], config.trainer.positions)
    result = {"steps": steps, "seconds": round(time.perf_counter() - started, 1)}
    result["domain"] = meter(trainer, args.domain, "candidate", args.max_tokens)
    print(f"  offline ({steps} steps on the same records): {result}", flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_online_vs_offline")
    parser.add_argument("--domain", default="sql")
    parser.add_argument("--records", type=int, default=240, help="training records to log")
    parser.add_argument("--chunk", type=int, default=40, help="records per point of the curve")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts")
    parser.add_argument(
        "--holdout", type=float, default=None, help="trainer.holdout_fraction (default: config's)"
    )
    parser.add_argument("--offline-epochs", type=int, default=40)
    parser.add_argument(
        "--prose-first", type=int, default=0, help="prose training records fed before the domain's"
    )
    add_output_args(parser)
    args = parser.parse_args(argv)
    paths, cache, target, base_draft, tokenizer = demo_setup(args, logging.INFO)
    started = time.perf_counter()
    engine = SpeculativeDecoder(target, base_draft, tokenizer)
    train_prompts = _prompts(paths, args.domain, "train")[: args.records]
    eval_prompts = _prompts(paths, args.domain, "heldout")[: args.eval_prompts]
    prose_prompts = _prompts(paths, "prose", "heldout")[: args.eval_prompts]
    records = log_records(engine, train_prompts, args.domain, args.max_tokens, "train", cache)
    eval_records = log_records(engine, eval_prompts, args.domain, args.max_tokens, "eval", cache)
    prose_records = log_records(engine, prose_prompts, "prose", args.max_tokens, "prose", cache)
    prose_train_prompts = _prompts(paths, "prose", "train")[: args.prose_first]
    prose_train = log_records(engine, prose_train_prompts, "prose", args.max_tokens, "pt", cache)
    print(
        f"logged {len(records)} training + {len(eval_records)} held-out {args.domain!r} records "
        f"and {len(prose_records)} prose ones in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    meter = Meter(target, tokenizer, eval_records, eval_prompts)
    prose_meter = Meter(target, tokenizer, prose_records, prose_prompts)
    online = run_online(args, copy.deepcopy(base_draft), records, meter, prose_meter, prose_train)
    offline = run_offline(args, copy.deepcopy(base_draft), records, meter)
    base, last = online[0]["domain"], online[-1]["domain"]  # prose records leave it as it is
    summary = {}
    for key in ("estimate", "measured"):
        online_gain = last[key] - base[key]
        offline_gain = offline["domain"][key] - base[key]
        summary[key] = {
            "base": base[key],
            "online": last[key],
            "offline": offline["domain"][key],
            "online_gain": round(online_gain, 4),
            "offline_gain": round(offline_gain, 4),
            "online_over_offline": round(online_gain / offline_gain, 3) if offline_gain else None,
        }
    print(f"\n{args.domain}: acceptance on held-out prompts (base -> online -> offline)")
    for key, row in summary.items():
        print(
            f"  {key:<9} {row['base']:.3f} -> {row['online']:.3f} -> {row['offline']:.3f}: "
            f"online gain {row['online_gain']:+.3f} = {row['online_over_offline']} of offline's "
            f"{row['offline_gain']:+.3f}"
        )
    prose_before = online[1 if prose_train else 0]["general_on_prose"]  # after its prose
    prose_after = online[-1]["general_on_prose"]
    print(
        f"  general adapter on prose: estimate {prose_before['estimate']:.3f} -> "
        f"{prose_after['estimate']:.3f}, measured {prose_before['measured']:.3f} -> "
        f"{prose_after['measured']:.3f}"
    )
    if args.out:
        result = {"args": vars(args), "online": online, "offline": offline, "summary": summary}
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
