"""Replay batches mix fresh and remembered records; entries are acknowledged once every adapter
they were routed to has trained on them."""

from __future__ import annotations

import numpy as np
import pytest

from osd.buffer.record import Record
from trainer.examples import Example
from trainer.replay import AckTracker, AdapterData, DomainWindows

_RECORD = Record.make_dummy(num_generated=4, vocab_size=32, m=4)


def examples(prefix: str, n: int) -> list[Example]:
    return [Example(f"{prefix}-{i}", _RECORD, float(i)) for i in range(n)]


def filled(num_fresh: int, num_replay: int, replay_size: int = 100) -> AdapterData:
    data = AdapterData(replay_size=replay_size, holdout_size=10)
    data.fresh.extend(examples("f", num_fresh))  # as if pushed out of the judge's window
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


def domain_examples(domain: str, n: int) -> list[Example]:
    record = Record.make_dummy(num_generated=4, vocab_size=32, m=4, domain=domain)
    return [Example(f"{domain}-{i}", record, float(i)) for i in range(n)]


def test_a_flood_of_one_domain_keeps_the_others_in_replay_and_replays_them_in_equal_shares():
    data = AdapterData(replay_size=10, holdout_size=10)
    data.trained(domain_examples("prose", 10))
    data.trained(domain_examples("code", 500))  # the flood
    assert len(data.replay) == 20
    assert [e.entry_id for e in data.replay.by_domain()["prose"]] == [
        f"prose-{i}" for i in range(10)
    ]
    batch, _ = data.next_batch(8, np.random.default_rng(0))
    domains = [e.record.domain for e in batch]
    assert domains.count("prose") == domains.count("code") == 4
    assert len({e.entry_id for e in batch}) == 8


def test_domain_windows_drop_the_least_recently_fed_domain_beyond_the_cap():
    windows = DomainWindows(size=3, max_domains=2)
    windows.extend(domain_examples("a", 2))
    windows.extend(domain_examples("b", 2))
    windows.append(domain_examples("a", 3)[2])  # a is fed again: b is now the least recent
    windows.extend(domain_examples("c", 1))
    assert sorted(windows.by_domain()) == ["a", "c"]
    assert len(windows) == 4
    assert len(windows.sample(10, np.random.default_rng(0))) == 4  # no more than there is
    with pytest.raises(ValueError, match="max_domains"):
        DomainWindows(size=3, max_domains=0)


def ids(examples_: list[Example]) -> list[str]:
    return [e.entry_id for e in examples_]


def test_records_judge_first_and_train_once_newer_ones_push_them_out_of_the_judges_window():
    data = AdapterData(replay_size=100, holdout_size=50, holdout_fraction=0.25, min_holdout=8)
    released = [data.add(e) for e in domain_examples("code", 16)]
    # The first 8 only judge; each later one pushes the oldest held-out record into training.
    assert released[:8] == [[]] * 8
    assert [ids(r) for r in released[8:]] == [[f"code-{i}"] for i in range(8)]
    assert ids(list(data.holdout)) == [f"code-{i}" for i in range(8, 16)]
    assert ids(list(data.fresh)) == [f"code-{i}" for i in range(8)]
    # The window then grows with the domain's traffic (a quarter of it), up to holdout_size.
    for e in domain_examples("code", 400)[16:]:
        data.add(e)
    assert len(data.holdout) == 50
    assert ids(list(data.holdout)) == [f"code-{i}" for i in range(350, 400)]
    assert len(data.fresh) + len(data.holdout) == 400  # nothing dropped
    assert not set(ids(list(data.fresh))) & set(ids(list(data.holdout)))


def test_each_domain_has_its_own_judging_window_and_a_dropped_window_trains_its_records():
    data = AdapterData(replay_size=100, holdout_size=50, max_domains=2, min_holdout=4)
    for domain in ("a", "b"):
        for e in domain_examples(domain, 6):
            data.add(e)
    assert {d: len(w) for d, w in data.holdout.by_domain().items()} == {"a": 4, "b": 4}
    assert ids(list(data.fresh)) == ["a-0", "a-1", "b-0", "b-1"]
    released = data.add(domain_examples("c", 1)[0])  # a third domain: a's window makes room
    assert ids(released) == ["a-2", "a-3", "a-4", "a-5"]
    assert sorted(data.holdout.by_domain()) == ["b", "c"]
    assert len(data.fresh) + len(data.holdout) == 13


def test_judging_window_bounds_are_checked_and_capped():
    data = AdapterData(replay_size=10, holdout_size=3, min_holdout=8)
    assert data.holdout_target("x") == 3  # min_holdout never beyond holdout_size
    with pytest.raises(ValueError, match="holdout_fraction"):
        AdapterData(replay_size=10, holdout_size=3, holdout_fraction=1.0)
