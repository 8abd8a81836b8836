"""Routing, hold-out and position selection of records, and their padding into batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from osd.buffer.record import Record
from trainer.examples import (
    adapters_for,
    collate,
    is_held_out,
    rejected_positions,
    train_positions,
    window_key,
)


def record_with_steps(
    drafted: list[int],
    accepted: list[int],
    *,
    num_generated: int | None = None,
    prompt_len: int = 3,
    m: int = 4,
    domain: str = "",
    request_id: str = "r",
    seed: int = 0,
    step_proposers: list[int] | None = None,
) -> Record:
    """A consistent record whose steps are given; each step emits accepted + 1 tokens."""
    emitted = sum(a + 1 for a in accepted)
    num_generated = emitted if num_generated is None else num_generated
    rng = np.random.default_rng(seed)
    top_ids = np.stack([rng.choice(16, size=m, replace=False) for _ in range(num_generated)])
    top_probs = np.sort(rng.dirichlet(np.ones(m + 1), size=num_generated)[:, :m], axis=1)[:, ::-1]
    return Record(
        request_id=request_id,
        created_at=1.0,
        domain=domain,
        adapter_name="general",
        adapter_version=0,
        method="block",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=64,
        seed=0,
        num_spec_tokens=4,
        num_drafts=1,
        prompt_len=prompt_len,
        token_ids=rng.integers(0, 16, size=prompt_len + num_generated),
        num_drafted=np.array(drafted),
        num_accepted=np.array(accepted),
        draft_token_probs=np.full(sum(drafted), 0.5, dtype=np.float16),
        target_top_ids=top_ids,
        target_top_probs=top_probs.astype(np.float16),
        step_proposers=step_proposers,
    )


@pytest.mark.parametrize(
    ("drafted", "accepted", "num_generated", "expected"),
    [
        ([4, 4, 4, 2], [2, 4, 0, 1], None, [2, 8, 10]),  # step 2 accepted all: bonus, not wrong
        ([4, 4, 4, 2], [2, 4, 0, 1], 10, [2, 8]),  # the last step was cut by a stop token
        ([3, 3], [3, 3], None, []),  # everything accepted
        ([1, 1, 1], [0, 0, 0], None, [0, 1, 2]),  # everything rejected
    ],
)
def test_rejected_positions_follow_the_accepted_prefix_of_each_step(
    drafted, accepted, num_generated, expected
):
    record = record_with_steps(drafted, accepted, num_generated=num_generated)
    assert rejected_positions(record).tolist() == expected
    mask = train_positions(record, "rejected")
    assert np.flatnonzero(mask).tolist() == expected
    assert train_positions(record, "all").all()


def test_rejections_of_looked_up_drafts_are_not_the_draft_models():
    # Steps 0 and 2 were drafted by suffix decoding (code 1): their rejections say nothing of
    # the draft model, and a schema-1 record (no codes) reads as the draft model throughout.
    record = record_with_steps([4, 4, 4, 2], [2, 4, 0, 1], step_proposers=[1, 0, 1, 0])
    assert rejected_positions(record).tolist() == [10]
    again = Record.unpack(record.pack())
    assert again.step_proposers.tolist() == [1, 0, 1, 0]
    assert again.model_steps.tolist() == [False, True, False, True]


def test_general_adapter_learns_from_all_records_and_domain_adapters_from_their_domain():
    names = ["general", "code", "math"]
    route = {d: adapters_for(record_with_steps([1], [0], domain=d), names) for d in names}
    assert route == {
        "general": ["general"],
        "code": ["general", "code"],
        "math": ["general", "math"],
    }
    assert adapters_for(record_with_steps([1], [0], domain="poetry"), names) == ["general"]
    assert adapters_for(record_with_steps([1], [0], domain=""), names) == ["general"]


def test_hold_out_is_deterministic_and_close_to_the_fraction():
    ids = [f"req-{i}" for i in range(20_000)]
    held = [is_held_out(i, 0.2) for i in ids]
    assert held == [is_held_out(i, 0.2) for i in ids]
    assert abs(sum(held) / len(ids) - 0.2) < 0.01
    assert not any(is_held_out(i, 0.0) for i in ids[:100])
    # A larger fraction only adds records to the hold-out set.
    assert all(is_held_out(i, 0.5) for i, h in zip(ids, held, strict=True) if h)
    with pytest.raises(ValueError, match="1.0"):
        is_held_out("x", 1.0)


def test_collate_aligns_each_generated_position_with_the_input_that_predicts_it():
    short = record_with_steps([2], [1], prompt_len=4, m=5, seed=1)  # 2 generated
    long = record_with_steps([4, 4], [2, 3], prompt_len=2, m=4, seed=2)  # 7 generated
    batch = collate([short, long], "rejected")

    assert batch.input_ids.shape == (2, len(long.token_ids) - 1)
    assert batch.target_top_ids.shape[-1] == 4  # the smaller m
    assert batch.first_index == 1
    for row, record in enumerate([short, long]):
        num_inputs = len(record.token_ids) - 1
        assert batch.input_ids[row, :num_inputs].tolist() == record.token_ids[:-1].tolist()
        assert batch.attention_mask[row].sum() == num_inputs
        start = record.prompt_len - 1
        assert torch.equal(
            batch.target_top_ids[row, start : start + record.num_generated],
            torch.tensor(record.target_top_ids[:, :4], dtype=torch.long),
        )
        assert batch.eval_mask[row].nonzero().squeeze(1).tolist() == list(
            range(start, start + record.num_generated)
        )
        expected = [start + int(p) for p in rejected_positions(record)]
        assert batch.train_mask[row].nonzero().squeeze(1).tolist() == expected
    assert batch.num_tokens == len(short.token_ids) - 1 + len(long.token_ids) - 1


def test_collate_refuses_records_without_prompt_or_generated_tokens():
    with pytest.raises(ValueError, match="empty"):
        collate([], "all")
    with pytest.raises(ValueError, match="prompt_len=0"):
        collate([record_with_steps([1], [0], prompt_len=0)], "all")


def test_windows_are_the_domain_adapters_plus_one_bucket_for_any_other_label():
    adapters = ["general", "code", "sql"]
    labels = ["code", "sql", "prose", "", "general", "made-up-1", "made-up-2"]
    keys = [window_key(Record.make_dummy(domain=label), adapters) for label in labels]
    assert keys == ["code", "sql", "", "", "", "", ""]
