"""osd.decode.sampling, function by function, on hand-made tables: what each filter keeps, in
which order they apply, greedy decoding, and drawing a token by inverting the CDF.

The penalties and the logit bias against a reference written from their definitions are in
``test_penalties.py``; a row's independence from its batch in ``test_core.py``; exactness
through the engine in ``test_monte_carlo.py``. These tests need no model.
"""

from __future__ import annotations

import math

import pytest
import torch

from osd.decode.sampling import (
    GREEDY_BELOW,
    RowSampling,
    SamplingParams,
    logits_to_probs,
    rows_to_probs,
    sample_from_probs,
)
from osd.errors import ParamError

# Probabilities 0.4, 0.3, 0.2, 0.1 at temperature 1: every filter's cut can be worked by hand.
PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
LOGITS = PROBS.log()


def kept(probs: torch.Tensor) -> list[int]:
    return torch.nonzero(probs > 0).flatten().tolist()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias"),  # JSON-style string keys are no token ids
        ({"logit_bias": ((1, -100.5),)}, "logit_bias"),
    ],
)
def test_bad_parameters_are_refused_naming_the_parameter(kwargs, param):
    with pytest.raises(ParamError) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param == param
    assert param in str(refused.value)


@pytest.mark.parametrize("temperature", [0.0, GREEDY_BELOW / 2, 1e-300])
def test_a_temperature_below_the_greedy_line_is_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0 and params.is_greedy


def test_a_temperature_at_the_greedy_line_samples():
    assert not SamplingParams(temperature=GREEDY_BELOW).is_greedy


def test_logit_bias_is_stored_as_sorted_float_pairs_from_a_mapping_or_pairs():
    from_mapping = SamplingParams(logit_bias={5: 1, 2: -3})
    from_pairs = SamplingParams(logit_bias=((5, 1.0), (2, -3.0)))
    assert from_mapping.logit_bias == from_pairs.logit_bias == ((2, -3.0), (5, 1.0))
    assert all(isinstance(value, float) for _, value in from_mapping.logit_bias)


@pytest.mark.parametrize(
    ("kwargs", "uses_history"),
    [
        ({}, False),
        ({"logit_bias": {1: 2.0}, "min_p": 0.5}, False),  # depend on the logits alone
        ({"presence_penalty": 0.5}, True),
        ({"frequency_penalty": -0.5}, True),
        ({"repetition_penalty": 1.2}, True),
    ],
)
def test_only_the_penalties_need_the_prefix(kwargs, uses_history):
    assert SamplingParams(**kwargs).uses_history is uses_history


PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=1.7, top_k=3),
    SamplingParams(top_p=0.5),
    SamplingParams(min_p=0.2, top_k=10),
    SamplingParams(temperature=0.0, logit_bias={4: 3.0}),
    SamplingParams(temperature=0.8, top_k=1, top_p=0.1, min_p=1.0),
]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_every_distribution_sums_to_one_with_no_negative_mass(params, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 32) * 4).to(dtype)  # any leading dimensions
    probs = logits_to_probs(logits, params)
    assert probs.shape == logits.shape
    assert probs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 5, dtype=probs.dtype))


def test_temperature_divides_the_logits_before_the_softmax():
    for temperature in (0.5, 1.0, 2.0):
        got = logits_to_probs(LOGITS, SamplingParams(temperature=temperature))
        expected = PROBS ** (1 / temperature) / (PROBS ** (1 / temperature)).sum()
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_greedy_is_one_hot_on_the_argmax_after_the_bias():
    plain = logits_to_probs(LOGITS, SamplingParams(temperature=0.0))
    assert plain.tolist() == [1.0, 0.0, 0.0, 0.0]
    # The bias moves the argmax: greedy decodes the processed logits, not the raw ones.
    biased = logits_to_probs(LOGITS, SamplingParams(temperature=0.0, logit_bias={3: 2.0}))
    assert biased.tolist() == [0.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [
        (1, [1.0, 0.0, 0.0, 0.0]),
        (2, [4 / 7, 3 / 7, 0.0, 0.0]),
        (3, [4 / 9, 3 / 9, 2 / 9, 0.0]),
        (4, PROBS.tolist()),
        (0, PROBS.tolist()),  # off
        (100, PROBS.tolist()),  # more than the vocabulary: everything
    ],
)
def test_top_k_keeps_the_k_most_likely_renormalised(top_k, expected):
    got = logits_to_probs(LOGITS, SamplingParams(top_k=top_k))
    torch.testing.assert_close(got, torch.tensor(expected, dtype=got.dtype), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("top_p", "kept_ids"),
    [
        (1e-6, [0]),  # the most likely token always stays
        (0.39, [0]),  # the first token's mass (0.4) reaches it
        (0.41, [0, 1]),
        (0.69, [0, 1]),  # two reach it (0.7): the third is not needed
        (0.71, [0, 1, 2]),
        (0.95, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_most_likely_set_reaching_the_mass(top_p, kept_ids):
    # Cuts away from the exact sums (0.4, 0.7, 0.9), which the softmax rounds either way.
    probs = logits_to_probs(LOGITS, SamplingParams(top_p=top_p))
    assert kept(probs) == kept_ids
    expected = torch.zeros(4, dtype=torch.float64)
    expected[kept_ids] = PROBS[kept_ids] / PROBS[kept_ids].sum()
    torch.testing.assert_close(probs, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("min_p", "kept_ids"),
    # Cuts away from the exact ratios (0.25, 0.5, 0.75), which the softmax rounds either way.
    [(0.0, [0, 1, 2, 3]), (0.2, [0, 1, 2, 3]), (0.3, [0, 1, 2]), (0.6, [0, 1]), (1.0, [0])],
)
def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely(min_p, kept_ids):
    probs = logits_to_probs(LOGITS, SamplingParams(min_p=min_p))
    assert kept(probs) == kept_ids
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_top_p_applies_after_top_k_on_the_renormalised_distribution():
    # After top-k 2 the first token has 4/7 > 0.5 of the mass, so top-p 0.5 keeps it alone;
    # on the unfiltered distribution (0.4 < 0.5) it would have kept two.
    probs = logits_to_probs(LOGITS, SamplingParams(top_k=2, top_p=0.5))
    assert kept(probs) == [0]
    assert kept(logits_to_probs(LOGITS, SamplingParams(top_p=0.5))) == [0, 1]


def test_temperature_applies_before_the_filters():
    # At temperature 2 the first two tokens hold only ~0.61 of the mass (0.7 at 1), so top-p
    # 0.65 needs a third token.
    hot = logits_to_probs(LOGITS, SamplingParams(temperature=2.0, top_p=0.65))
    cold = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.65))
    assert kept(cold) == [0, 1] and kept(hot) == [0, 1, 2]


def test_disallowed_tokens_get_no_mass_even_when_greedy_or_most_likely():
    logits = LOGITS.expand(2, 4)
    allowed = torch.tensor([[False, True, True, False], [False, False, False, True]])
    rows = RowSampling.of([SamplingParams(), SamplingParams(temperature=0.0)], "cpu")
    probs = rows_to_probs(logits, rows, allowed=allowed)
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.6, 0.4, 0.0], dtype=probs.dtype))
    assert probs[1].tolist() == [0.0, 0.0, 0.0, 1.0]  # the argmax among the allowed


def test_logit_bias_beyond_the_vocabulary_is_refused_when_rows_are_built():
    with pytest.raises(ValueError, match="token 4; the vocabulary has 4"):
        RowSampling.of([SamplingParams(logit_bias={4: 1.0})], "cpu", vocab_size=4)


def test_selected_rows_keep_their_own_parameters_and_bias():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=2, logit_bias={3: 5.0}),
        SamplingParams(temperature=0.5, top_p=0.6),
    ]
    rows = RowSampling.of(params, "cpu", vocab_size=4)
    index = torch.tensor([2, 1, 1, 0])  # e.g. one row per draft branch
    logits = LOGITS.float().expand(4, 4)
    got = rows_to_probs(logits, rows.select(index))
    for branch, row in enumerate(index.tolist()):
        torch.testing.assert_close(got[branch], logits_to_probs(LOGITS.float(), params[row]))


@pytest.mark.parametrize(
    ("uniform", "token"),
    [(0.0, 0), (0.19, 0), (0.2, 1), (0.49, 1), (0.5, 2), (0.999999, 2)],
)
def test_a_draw_inverts_the_cumulative_distribution(uniform, token):
    probs = torch.tensor([0.2, 0.3, 0.5])
    assert int(sample_from_probs(probs, torch.tensor(uniform))) == token
    # Unnormalised weights are drawn from as their normalised distribution.
    assert int(sample_from_probs(probs * 7, torch.tensor(uniform))) == token


def test_evenly_spread_uniforms_draw_each_token_in_proportion_to_its_mass():
    probs = torch.tensor([0.125, 0.0, 0.5, 0.375])
    num_draws = 800
    uniforms = (torch.arange(num_draws, dtype=torch.float64) + 0.5) / num_draws
    ids = sample_from_probs(probs.expand(num_draws, 4), uniforms)
    assert ids.shape == (num_draws,) and ids.dtype == torch.int64
    assert torch.bincount(ids, minlength=4).tolist() == [100, 0, 400, 300]


@pytest.mark.parametrize(
    "probs",
    [
        [0.5, 0.5, 0.0, 0.0],  # zeros after the mass: rounding must not land on them
        [0.0, 1.0, 0.0],
        [0.0, 0.0, 1e-30, 0.0],
        [1.0 - 1e-7, 1e-7, 0.0],
        [0.5, 0.5, 1e-9, 0.0],  # the cdf reaches its top before the last token with mass
    ],
)
def test_a_token_of_zero_probability_is_never_drawn(probs):
    table = torch.tensor(probs, dtype=torch.float32)
    uniforms = torch.tensor([0.0, 1e-9, 0.5, 1.0 - 1e-12, 1.0 - 2**-24, 1.0])
    ids = sample_from_probs(table.expand(len(uniforms), -1), uniforms)
    assert bool((table[ids] > 0).all()), ids.tolist()
    # Rows of positions, as a verify step draws them: (B, T, V).
    grid = sample_from_probs(table.expand(2, len(uniforms), -1), uniforms.expand(2, -1))
    assert grid.tolist() == [ids.tolist(), ids.tolist()]
