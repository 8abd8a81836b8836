"""The batched engine's pure parts: random streams, admission, slot-cache plans, row sampling."""

from __future__ import annotations

import pytest
import torch

from osd.decode import rng
from osd.decode.kv_cache import ForwardPlan, SlotKVCache, plan_forward
from osd.decode.models import CausalLM
from osd.decode.sampling import RowSampling, SamplingParams, logits_to_probs, rows_to_probs
from osd.decode.scheduler import BatchLimits, num_to_admit
from osd.testing import tiny_llama

_MASK = (1 << 64) - 1


def splitmix64(state: int) -> int:
    z = state & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def test_uniforms_equal_splitmix64_reference_despite_int64_wraparound():
    keys = [rng.stream_key(seed, rng.DRAFT_STREAM) for seed in (0, 1, 2**62 + 5, -3)]
    counters = torch.tensor([[0, 1, 2**40 + 7]] * 4)
    draws = rng.uniforms(torch.tensor(keys), counters)
    for row, key in enumerate(keys):
        for col, count in enumerate(counters[row].tolist()):
            expected = (splitmix64(key + count * 0x9E3779B97F4A7C15) >> 11) / 2**53
            assert float(draws[row, col]) == expected


def test_streams_are_distinct_for_every_seed_bit_sign_and_stream():
    seeds = (1, 1 + 2**40, 1 + 2**70, 0, -1, 4, -5, 2**63 - 1, -(2**63))
    keys = {rng.stream_key(seed, stream) for seed in seeds for stream in (1, 2)}
    assert len(keys) == 2 * len(seeds)  # high bits and the sign count; the streams differ


def test_uniforms_look_uniform_and_uncorrelated():
    keys = torch.tensor([rng.stream_key(s, 1) for s in range(500)])
    draws = rng.uniforms(keys, torch.arange(400).expand(500, -1))
    assert abs(float(draws.mean()) - 0.5) < 0.003
    assert abs(float(draws.var()) - 1 / 12) < 0.002
    lag = float((draws[:, 1:] * draws[:, :-1]).mean())
    assert abs(lag - 0.25) < 0.003


@pytest.mark.parametrize(
    ("needed", "running", "free", "max_seqs", "admitted"),
    [
        ([1, 1, 1], 0, 8, 8, 3),
        ([1, 1, 1], 6, 8, 8, 2),  # the batch is nearly full
        ([3, 1], 0, 2, 8, 0),  # the head needs 3 slots: nobody overtakes it
        ([2, 1, 1], 0, 3, 8, 2),
        ([], 0, 8, 8, 0),
    ],
)
def test_admission_is_in_order_within_rows_and_slots(needed, running, free, max_seqs, admitted):
    assert (
        num_to_admit(needed, num_running=running, free_slots=free, max_num_seqs=max_seqs)
        == admitted
    )


def test_batch_limits_reject_bad_values():
    with pytest.raises(ValueError, match="max_num_seqs"):
        BatchLimits(max_num_seqs=0)
    assert BatchLimits(max_num_seqs=4).num_slots == 4


def test_plan_masks_padding_and_sends_its_writes_to_the_trash_slot():
    plan = plan_forward(
        input_ids=torch.tensor([[0, 5, 6, 0], [7, 8, 9, 1]]),
        start=torch.tensor([10, 0]),
        left=torch.tensor([1, 0]),
        real=torch.tensor([2, 3]),
        own_slot=torch.tensor([0, 1]),
        base_slot=torch.tensor([2, 1]),
        prefix_len=torch.tensor([4, 0]),
        trash_slot=9,
        dtype=torch.float32,
    )
    assert plan.write_slot.tolist() == [[9, 0, 0, 9], [1, 1, 1, 9]]
    assert plan.write_pos[0, 1:3].tolist() == [10, 11]
    assert plan.position_ids.tolist() == [[0, 10, 11, 0], [0, 1, 2, 0]]  # padding at 0
    assert plan.read_slot[0, :6].tolist() == [2, 2, 2, 2, 0, 0]  # prefix from the base slot
    visible = plan.attention_mask[:, 0] == 0
    assert visible[1, 0].tolist()[:4] == [True, False, False, False]
    assert ForwardPlan.make_dummy(batch=3).input_ids.shape == (3, 3)


def test_slot_cache_forwards_equal_plain_forwards_for_ragged_rows_and_branches():
    model = tiny_llama(vocab_size=64, hidden_size=32, num_layers=2, seed=0, logit_scale=4.0)
    lm, cache = CausalLM(model, 64), SlotKVCache(4, 40)
    sequences = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10]]

    def run(rows, start, own, base, prefix):
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        plan = plan_forward(
            input_ids=ids,
            start=torch.tensor(start),
            left=torch.tensor([width - len(r) for r in rows]),
            real=torch.tensor([len(r) for r in rows]),
            own_slot=torch.tensor(own),
            base_slot=torch.tensor(base),
            prefix_len=torch.tensor(prefix),
            trash_slot=cache.trash_slot,
            dtype=torch.float32,
        )
        return lm.run(plan, cache, num_logits=1)[:, 0]

    with torch.no_grad():
        run([s[:-1] for s in sequences[:2]], [0, 0], [0, 1], [0, 1], [0, 0])
        last = run([s[-1:] for s in sequences], [5, 2, 0], [0, 1, 2], [0, 1, 2], [0, 0, 0])
        branch = run([[11, 12]], [6], [3], [0], [6])  # reads slot 0's prefix, writes slot 3
        plain = [model(torch.tensor([s])).logits[0, -1] for s in sequences]
        plain_branch = model(torch.tensor([sequences[0] + [11, 12]])).logits[0, -1]
    torch.testing.assert_close(last, torch.stack(plain), atol=1e-5, rtol=0)
    torch.testing.assert_close(branch[0], plain_branch, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="slots hold 40"):
        run([[1] * 3], [39], [0], [0], [0])


def test_a_rows_sampling_does_not_depend_on_the_other_rows_parameters():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 50)
    params = [
        SamplingParams(0.0),
        SamplingParams(0.7, top_p=0.9),
        SamplingParams(1.3, top_k=5),
        SamplingParams(1.0, top_p=0.5, top_k=10),
    ]
    together = rows_to_probs(logits, RowSampling.of(params, "cpu"))
    for row, p in enumerate(params):
        torch.testing.assert_close(
            together[row], logits_to_probs(logits[row], p), atol=1e-6, rtol=0
        )
