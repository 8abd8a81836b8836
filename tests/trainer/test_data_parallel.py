"""One adapter trained data parallel: two processes over gloo on the CPU take the same steps as
one process within float tolerance, shards are balanced, and the group stops cleanly."""

from __future__ import annotations

import json
import multiprocessing
import re

import pytest
import torch

from osd.adapters import open_adapter_store
from osd.buffer.record import Record
from osd.config import ModelConfig, TrainerConfig
from tests.trainer.conftest import headroom_draft, push, trainer_overrides
from tests.trainer.test_restart import start_trainer
from trainer.data_parallel import DataParallel, backend_for, split_records
from trainer.data_parallel_launch import free_address
from trainer.draft_trainer import DraftTrainer

MODEL = ModelConfig(target="toy:target", draft="toy:draft", adapters=("general", "code"))
# What two processes may differ from one by, after the steps below: the shards' losses and
# gradients are summed in another order than one device sums them (float rounding only).
TOLERANCE = 2e-5  # measured: 2.8e-6 on an Intel Xeon
NUM_STEPS = 4


def new_trainer(group: DataParallel | None = None) -> DraftTrainer:
    return DraftTrainer(
        headroom_draft(), MODEL, MODEL.adapters, base_model_id="toy", learning_rate=3e-3,
        data_parallel=group,
    )  # fmt: skip


def steps(records: list[Record]) -> list[tuple[str, list[Record]]]:
    """Steps of both adapters, one with a single record (the second rank's shard is empty)."""
    return [
        ("general", records[:8]),
        ("code", records[8:13]),
        ("general", records[13:14]),
        ("general", records[14:30]),
    ]


def _follower(address: str) -> None:
    torch.set_num_threads(1)
    group = DataParallel(1, 2, address, "gloo", timeout_s=60)
    taken = group.follow(new_trainer(group))
    raise SystemExit(0 if taken == NUM_STEPS else 1)


def test_two_processes_take_the_steps_one_process_takes(records):
    alone = new_trainer()
    expected = [alone.train_step(a, batch, "all") for a, batch in steps(records)]

    address = free_address()
    child = multiprocessing.get_context("fork").Process(target=_follower, args=(address,))
    child.start()
    group = DataParallel(0, 2, address, "gloo", timeout_s=60)
    try:
        leader = new_trainer(group)
        got = [leader.train_step(a, batch, "all") for a, batch in steps(records)]
    finally:
        group.stop()
        child.join(timeout=30)
    assert child.exitcode == 0

    for one, two in zip(expected, got, strict=True):
        assert (two.num_tokens, two.num_positions) == (one.num_tokens, one.num_positions)
        assert abs(two.loss - one.loss) < TOLERANCE
    worst = 0.0
    for adapter in MODEL.adapters:
        mine, theirs = leader.weights(adapter), alone.weights(adapter)
        for key, value in theirs.items():
            worst = max(worst, float((mine[key] - value).abs().max()))
    print(f"\n[data parallel] largest weight difference from one process: {worst:.2e}")
    assert worst < TOLERANCE
    # The steps moved the weights far more than that: the comparison means something.
    assert any(
        float((alone.weights("general")[k] - v).abs().max()) > 100 * TOLERANCE
        for k, v in new_trainer().weights("general").items()
    )


def test_osd_train_on_two_cpu_devices_trains_publishes_and_stops_its_follower(
    tmp_path, redis_url, stream, records
):
    push(redis_url, stream, records[:64])
    overrides = trainer_overrides(tmp_path, stream, devices="[cpu,cpu]", publish_margin=0.0)
    proc = start_trainer(redis_url, overrides, "--exit-when-idle", "2")
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    stats = json.loads(out.strip().splitlines()[-1])["trainer_stats"]
    assert stats["read"] == 64 and stats["published"] >= 1
    assert "rank 1 of 2 on cpu: following" in err
    steps = int(re.search(r"rank 1: stopped after (\d+) steps", err).group(1))
    assert steps >= 20  # every step of the round ran on both ranks
    store = open_adapter_store(str(tmp_path / "adapters"))
    assert store.current("general") is not None


def test_shards_split_the_tokens_evenly_and_keep_every_record(records):
    shards = split_records(records[:30], 3)
    assert sorted(r.request_id for s in shards for r in s) == sorted(
        r.request_id for r in records[:30]
    )
    tokens = [sum(len(r.token_ids) for r in s) for s in shards]
    longest = max(len(r.token_ids) for r in records[:30])
    assert max(tokens) - min(tokens) <= longest
    order = [r.request_id for r in records[:30]]
    for shard in shards:  # records keep their order within a shard
        ids = [r.request_id for r in shard]
        assert ids == sorted(ids, key=order.index)
    assert [len(s) for s in split_records(records[:1], 2)] == [1, 0]
    with pytest.raises(ValueError, match="num_shards"):
        split_records(records, 0)


def test_devices_of_two_kinds_are_refused():
    assert backend_for(["cpu", "cpu"]) == "gloo"
    assert backend_for(["cuda:0", "cuda:1"]) == "nccl"
    with pytest.raises(ValueError, match="trainer.devices"):
        TrainerConfig(devices=("cuda:0", "cpu"))
    with pytest.raises(ValueError, match="trainer.devices"):
        TrainerConfig(devices=("tpu", "tpu"))
