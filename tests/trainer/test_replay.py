"""Replay batches mix fresh and remembered records; entries are acknowledged once every adapter
they were routed to has trained on them."""

from __future__ import annotations

import numpy as np
import pytest

from osd.record import Record
from trainer.examples import Example
from trainer.replay import AckTracker, AdapterData

_RECORD = Record.make_dummy(num_generated=4, vocab_size=32, m=4)


def examples(prefix: str, n: int) -> list[Example]:
    return [Example(f"{prefix}-{i}", _RECORD, float(i)) for i in range(n)]


def filled(num_fresh: int, num_replay: int, replay_size: int = 100) -> AdapterData:
    data = AdapterData(replay_size=replay_size, holdout_size=10)
    for e in examples("f", num_fresh):
        data.add_fresh(e)
    data.trained(examples("r", num_replay))
    return data


@pytest.mark.parametrize(
    ("num_fresh", "num_replay", "expected_fresh", "expected_replay"),
    [
        (20, 50, 8, 8),  # half fresh, half replay
        (20, 0, 16, 0),  # no window yet: all fresh
        (0, 50, 0, 16),  # nothing new: replay only
        (3, 50, 3, 13),  # few fresh: the window fills the batch
        (20, 5, 11, 5),  # short window: more fresh
        (0, 0, 0, 0),  # nothing at all
    ],
)
def test_batches_take_half_fresh_and_fill_from_replay(
    num_fresh, num_replay, expected_fresh, expected_replay
):
    data = filled(num_fresh, num_replay)
    batch, fresh = data.next_batch(16, np.random.default_rng(0))
    assert len(fresh) == expected_fresh
    assert len(batch) == expected_fresh + expected_replay
    assert [e.entry_id for e in fresh] == [f"f-{i}" for i in range(expected_fresh)]  # oldest first
    replayed = batch[expected_fresh:]
    assert len({e.entry_id for e in replayed}) == len(replayed)  # no duplicates
    assert all(e.entry_id.startswith("r-") for e in replayed)


def test_replay_window_keeps_only_the_newest_records():
    data = filled(0, 0, replay_size=5)
    data.trained(examples("r", 12))
    assert [e.entry_id for e in data.replay] == [f"r-{i}" for i in range(7, 12)]


def test_requeued_fresh_records_come_back_first_in_order():
    data = filled(6, 0)
    _, fresh = data.next_batch(4, np.random.default_rng(0))
    data.requeue(fresh)
    assert [e.entry_id for e in data.fresh] == [f"f-{i}" for i in range(6)]


def test_entry_is_acknowledged_after_every_routed_adapter_used_it():
    acks = AckTracker()
    acks.expect("1-0", 2)  # general and code
    acks.expect("2-0", 1)  # general only
    assert acks.used(["1-0", "2-0"]) == ["2-0"]
    assert "1-0" in acks and len(acks) == 1
    assert acks.used(["1-0"]) == ["1-0"]
    assert len(acks) == 0
    with pytest.raises(ValueError, match="num_adapters"):
        acks.expect("3-0", 0)
