"""Fixtures for the trainer: a real redis-server, records logged by a real `SpeculativeDecoder`
on tiny models built in code, and configs that keep everything in a temporary directory."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from osd import SpeculativeDecoder
from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis, connect
from osd.config import OSDConfig, load_config
from osd.distill.acceptance import AcceptanceEstimate, estimate_acceptance
from osd.testing import noisy_copy, tiny_llama
from trainer.examples import collate

torch.set_num_threads(1)

NUM_RECORDS = 128


def toy_target():
    """The target of the records: the toy pair's target (`osd.model_sources`, ``toy:``)."""
    return tiny_llama(vocab_size=64, hidden_size=64, num_layers=2, seed=0, logit_scale=4.0)


def headroom_draft():
    """A draft far enough from the target that distillation has something to gain."""
    return noisy_copy(toy_target(), 0.5, seed=1)


def generate_records(
    num_records: int, *, seed: int, domain: str = "", prefix: str = "req"
) -> list[Record]:
    """Records of real speculative generations (block verification, temperature 1)."""
    target = toy_target()
    engine = SpeculativeDecoder(target, headroom_draft(), None, log_top_m=32)
    rng = np.random.default_rng(seed)
    records = []
    for i in range(num_records):
        prompt = rng.integers(2, 64, size=int(rng.integers(3, 10))).tolist()
        result = engine.generate(
            prompt, max_tokens=24, temperature=1.0, seed=seed * 100_000 + i, num_spec_tokens=4
        )
        assert result.log is not None
        records.append(
            Record.from_generation(result.log, request_id=f"{prefix}-{seed}-{i}", domain=domain)
        )
    return records


@pytest.fixture(scope="session")
def records() -> list[Record]:
    """Records of one traffic stream with no domain."""
    return generate_records(NUM_RECORDS, seed=0)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with LocalRedis() as server:
        yield server.url


@pytest.fixture
def stream() -> str:
    return f"test:{uuid.uuid4().hex[:12]}"


def push(redis_url: str, stream: str, records: Sequence[Record]) -> list[str]:
    """Appends records to the stream the way `LogWriter` does; returns their entry ids."""
    client = connect(redis_url)
    try:
        pipe = client.pipeline(transaction=False)
        for record in records:
            pipe.xadd(stream, {"r": record.pack()})
        return [i.decode() if isinstance(i, bytes) else i for i in pipe.execute()]
    finally:
        client.close()


def trainer_overrides(tmp_path: Path, stream: str, **trainer: object) -> list[str]:
    """Overrides for a fast CPU trainer writing only under tmp_path."""
    settings = {
        "batch_records": 16,
        "steps_per_round": 20,
        "min_records": 16,
        "learning_rate": 3e-3,
        "holdout_fraction": 0.25,
        "min_holdout_records": 8,
        "max_record_wait_s": 0.2,
        "publish_margin": 0.01,
        "device": "cpu",
        "group": f"g-{uuid.uuid4().hex[:8]}",
        **trainer,
    }
    return [
        "model.target=toy:target",
        "model.draft=toy:draft",
        f"log.stream={stream}",
        "adapters.store=directory",
        f"adapters.root={tmp_path / 'adapters'}",
        "wandb.mode=disabled",
        f"run_dir={tmp_path / 'run'}",
        *(f"trainer.{k}={v}" for k, v in settings.items()),
    ]


def make_config(tmp_path: Path, stream: str, *extra: str, **trainer: object) -> OSDConfig:
    return load_config(None, [*trainer_overrides(tmp_path, stream, **trainer), *extra])


@torch.no_grad()
def model_acceptance(model, records: Sequence[Record]) -> AcceptanceEstimate:
    """Held-out acceptance of a plain (or peft, active adapter) model, computed independently of
    the trainer's own estimate."""
    batch = collate(records, "all")
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    ids, probs, _, eval_mask = (
        t[:, batch.first_index :]
        for t in (batch.target_top_ids, batch.target_top_probs, batch.train_mask, batch.eval_mask)
    )
    return estimate_acceptance(logits[:, batch.first_index :], ids, probs, eval_mask)
