"""The log stream's bound in bytes, as a pure trim-point calculation."""

from __future__ import annotations

import pytest

from osd.buffer.stream_budget import (
    REDIS_BYTES_PER_ENTRY,
    REDIS_BYTES_PER_PAYLOAD_BYTE,
    StreamBudget,
)

ENTRY_10K = REDIS_BYTES_PER_PAYLOAD_BYTE * 10_000 + REDIS_BYTES_PER_ENTRY


@pytest.mark.parametrize(
    ("maxlen", "max_bytes", "payloads", "trim_len"),
    [
        (1000, 0, [10_000], 1000),  # no budget in bytes: maxlen alone
        (1000, 10**9, [], 1000),  # nothing measured yet: maxlen
        (1000, 100 * ENTRY_10K, [10_000] * 5, 100),
        (50, 100 * ENTRY_10K, [10_000], 50),  # never above maxlen
        (1000, 10, [10_000], 1),  # at least one entry
    ],
)
def test_trim_point_is_the_budget_over_measured_entry_size_capped_by_maxlen(
    maxlen, max_bytes, payloads, trim_len
):
    budget = StreamBudget(maxlen, int(max_bytes))
    for size in payloads:
        budget.observe(size)
    assert budget.trim_len == trim_len


def test_mean_record_size_follows_a_change_of_traffic():
    budget = StreamBudget(10**9, 10**8)
    budget.observe(2_000)
    assert budget.mean_payload_bytes == 2_000
    for _ in range(200):
        budget.observe(50_000)  # long answers now
    assert budget.mean_payload_bytes == pytest.approx(50_000, rel=0.01)
    assert budget.trim_len == int(10**8 / (REDIS_BYTES_PER_PAYLOAD_BYTE * 50_000 + 64))


def test_a_full_redis_shrinks_the_stream_by_a_quarter_and_it_grows_back():
    budget = StreamBudget(maxlen=1000)
    budget.on_full(stream_len=400)  # something else filled Redis: the log gives way
    assert budget.trim_len == 300
    budget.on_full(stream_len=300)
    assert budget.trim_len == 225
    for _ in range(200):
        budget.on_accepted()
    assert budget.trim_len == 1000
    budget.on_full(stream_len=0)
    assert budget.trim_len == 10  # the floor: 1 % of the budget


@pytest.mark.parametrize(("maxlen", "max_bytes"), [(0, 0), (10, -1)])
def test_bad_bounds_raise(maxlen, max_bytes):
    with pytest.raises(ValueError, match="must be >= "):
        StreamBudget(maxlen, max_bytes)
