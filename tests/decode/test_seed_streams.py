"""Different seeds' draft and verify streams are independent (issue 14, item 6).

Before the counter-based streams, the CPU generator ignored a seed's high 32 bits, and seed s's
verify stream was seed s ^ 0x5EED's draft stream. ``test_core`` checks that the keys differ;
here the draws themselves are compared, every stream of one seed against every stream of the
other, with the same stream against itself as the negative control.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from osd import SpeculativeDecoder
from osd.decode import rng

STREAMS = (rng.DRAFT_STREAM, rng.VERIFY_STREAM)
NUM_DRAWS = 4096
# Independent draws correlate about N(0, 1/NUM_DRAWS): 5 standard deviations.
MAX_CORRELATION = 5 / NUM_DRAWS**0.5
PAIRS = [
    *((s, s ^ 0x5EED) for s in (0, 1, 12345, 2**40 + 3)),
    *((s, s + 2**32) for s in (0, 7, 2**31)),  # only the high 32 bits differ
    (5, 5 - 2**64),  # only bits above 64 and the sign
    (9, 9 ^ (1 << 63)),
]


def draws(seed: int, stream: int) -> torch.Tensor:
    """A stream's draws over the first steps' (branch, position) counters, flattened."""
    key = torch.tensor([rng.stream_key(seed, stream)])
    return rng.step_uniforms(key.repeat(64), torch.arange(64), 4, 16).flatten()  # (4096,)


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([x, y]))[0, 1])


@pytest.mark.parametrize(("seed", "other"), PAIRS)
def test_streams_of_different_seeds_share_no_draws_and_do_not_correlate(seed, other):
    for stream, other_stream in itertools.product(STREAMS, STREAMS):
        x, y = draws(seed, stream), draws(other, other_stream)
        assert not torch.any(x == y), (stream, other_stream)
        assert abs(correlation(x, y)) < MAX_CORRELATION, (stream, other_stream)
    x, y = draws(seed, rng.DRAFT_STREAM), draws(seed, rng.VERIFY_STREAM)
    assert abs(correlation(x, y)) < MAX_CORRELATION  # one seed's two streams
    assert correlation(x, draws(seed, rng.DRAFT_STREAM)) == pytest.approx(1.0)  # control


@pytest.mark.parametrize(("seed", "other"), [(7, 7 + 2**32), (7, 7 ^ 0x5EED), (7, 7 - 2**64)])
def test_generations_of_seeds_differing_in_high_bits_differ(target_model, lora_draft, seed, other):
    engine = SpeculativeDecoder(target_model, lora_draft)
    options = dict(max_tokens=40, num_spec_tokens=4, stop_token_ids=[], method="block")
    first = engine.generate([3, 5, 7], seed=seed, **options).token_ids
    assert engine.generate([3, 5, 7], seed=seed, **options).token_ids == first  # control
    assert engine.generate([3, 5, 7], seed=other, **options).token_ids != first


def test_the_hosts_draws_are_the_devices_bit_for_bit():
    """The engine draws on the host (numpy's uint64 splitmix); the device's int64 version is
    the reference: the same numbers, negative keys and high steps included."""
    import random

    import numpy as np

    draw = random.Random(7)
    keys = [
        rng.stream_key(draw.getrandbits(128) - (1 << 127), s) for s in (1, 2) for _ in range(64)
    ]
    steps = [draw.randrange(1 << 40) for _ in keys]
    device = rng.step_uniforms(torch.tensor(keys), torch.tensor(steps), 3, 9).numpy()
    assert np.array_equal(rng.step_draws(keys, steps, 3, 9), device)
    for empty in ((1, 0), (0, 4)):  # nothing to draw: the same (empty) shapes as the device's
        shape = rng.step_uniforms(torch.tensor(keys), torch.tensor(steps), *empty).shape
        assert rng.step_draws(keys, steps, *empty).shape == tuple(shape)
    counters = rng.counter(np.asarray(steps), 0, 5)
    on_device = rng.uniforms(torch.tensor(keys), torch.tensor(counters)).numpy()
    assert np.array_equal(rng.host_uniforms(np.asarray(keys), counters), on_device)
