"""Penalties, logit bias and min_p keep every method exact (osd.decode.sampling; docs/algorithms.md,
"Post-processing keeps verification exact").

The processing depends on the prefix, so within a drafted block position i must see the
drafted tokens before it. Checked three ways: the processing against a hand-written reference;
greedy speculation against the target alone (any history error changes the argmax path); and
the Monte Carlo chi-square of ``test_monte_carlo.py`` through the engine for each option, with
a negative control whose target positions ignore the block's earlier tokens.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from osd import SamplingParams, SpeculativeDecoder
from osd.decode import step as step_module
from osd.decode.loop import BatchedEngine
from osd.decode.prefix_history import History
from osd.decode.sampling import logits_to_probs
from osd.decode.scheduler import BatchLimits
from osd.testing import noisy_copy, tiny_llama
from tests.decode.test_monte_carlo import (
    LENGTH,
    NUM_SAMPLES,
    PROMPT,
    VOCAB,
    chi_square,
    sample_sequences,
)


def reference_probs(logits: torch.Tensor, params: SamplingParams, prompt, output) -> torch.Tensor:
    """One position's distribution, written out by hand from the definitions."""
    logits = logits.double().clone()
    for token, bias in params.logit_bias:
        logits[token] += bias
    for token in set(prompt) | set(output):
        value = logits[token]
        rep = params.repetition_penalty
        logits[token] = value / rep if value > 0 else value * rep
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    if params.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), len(logits)).double()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=1.0, temperature=0.7),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=-0.5),
    SamplingParams(logit_bias=((2, 2.0), (0, -1.5))),
    SamplingParams(min_p=0.3),
    SamplingParams(
        0.0, repetition_penalty=1.3, frequency_penalty=0.5, logit_bias=((1, 0.5),), min_p=0.2
    ),
]


@pytest.mark.parametrize("params", CASES)
def test_processing_matches_the_definitions(params):
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 2
    for prompt, output in [([1, 2], []), ([1, 2], [3, 3, 0]), ([0], [2, 1, 2, 2])]:
        history = History.of(prompt, output, VOCAB)
        got = logits_to_probs(logits.double(), params, history)
        torch.testing.assert_close(got, reference_probs(logits, params, prompt, output))


def test_invalid_options_are_refused_with_their_name():
    for kwargs, name in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="a penalty"):
        logits_to_probs(torch.zeros(VOCAB), SamplingParams(presence_penalty=1.0))


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=11, logit_scale=4.0)
    draft = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=13, logit_scale=4.0)
    return SpeculativeDecoder(target, draft)


def test_logit_bias_outside_the_vocabulary_is_refused(pair):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pair.prepare(PROMPT, logit_bias={VOCAB: 1.0})


@pytest.mark.parametrize("method", ["token", "block", "spectr"])
def test_greedy_speculation_with_penalties_is_the_target_alone(method):
    target = tiny_llama(vocab_size=32, hidden_size=32, num_layers=1, seed=3, logit_scale=4.0)
    decoder = SpeculativeDecoder(target, noisy_copy(target, 0.05, seed=4))
    options = {
        "temperature": 0.0,
        "repetition_penalty": 1.6,
        "frequency_penalty": 0.8,
        "presence_penalty": 0.4,
        "logit_bias": {7: 1.0},
        "max_tokens": 24,
    }
    for prompt in ([1, 2, 3], [5], [9, 9, 9, 4]):
        alone = decoder.generate(prompt, method="none", **options).token_ids
        spec = decoder.generate(prompt, method=method, num_spec_tokens=4, **options)
        assert spec.token_ids == alone
        assert spec.stats.accepted > 0  # speculation did run


def exact_sequence_probs(target, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Each 4-token sequence's probability under the processed target, position by position
    with that position's own prefix (History.of from plain lists)."""
    prefixes = list(itertools.product(range(VOCAB), repeat=LENGTH - 1))
    ids = torch.tensor([PROMPT + list(p) for p in prefixes], device=target.device)
    with torch.no_grad():
        logits = target(ids).logits[:, len(PROMPT) - 1 :].double().cpu()  # (N, LENGTH, V)
    out = {}
    for row, prefix in enumerate(prefixes):
        probs = [
            logits_to_probs(logits[row, i], params, History.of(PROMPT, prefix[:i], VOCAB))
            for i in range(LENGTH)
        ]
        for last in range(VOCAB):
            seq = (*prefix, last)
            out[seq] = math.prod(float(probs[i][seq[i]]) for i in range(LENGTH))
    return out


OPTIONS = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 1.2},
    "repetition": {"repetition_penalty": 2.0},
    "logit_bias": {"logit_bias": {2: 1.5, 0: -1.0}},
    "min_p": {"min_p": 0.25},
    "all": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.7,
        "repetition_penalty": 1.5,
        "logit_bias": {3: 1.0},
        "min_p": 0.1,
        "temperature": 0.9,
    },
}
BLOCK = {"method": "block", "num_spec_tokens": 2}
RUNS = [
    *(
        pytest.param(option, BLOCK, id=f"{name}-block")
        for name, option in OPTIONS.items()
        if name != "all"  # all options together: token and spectr below, block in the batch
    ),
    pytest.param(OPTIONS["all"], {"method": "token", "num_spec_tokens": 2}, id="all-token"),
    pytest.param(
        OPTIONS["all"],
        {"method": "spectr", "num_spec_tokens": 2, "num_drafts": 3},
        id="all-spectr",
    ),
]


def as_params(option: dict) -> SamplingParams:
    option = dict(option)
    option["logit_bias"] = tuple(option.get("logit_bias", {}).items())
    return SamplingParams(**option)


@pytest.mark.parametrize(("option", "method"), RUNS)
def test_emitted_sequences_follow_the_processed_target(pair, option, method):
    counts, acceptance = sample_sequences(pair, **option, **method)
    expected = exact_sequence_probs(pair.target.model, as_params(option))
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)
    print(f"chi2={stat:.1f} threshold={threshold:.1f} acceptance={acceptance:.2f}")
    assert 0.1 < acceptance < 0.95, acceptance  # both branches of the verifier run
    assert stat < threshold, (stat, threshold)


def test_negative_control_target_blind_to_the_block_fails(pair, monkeypatch):
    """Target positions that do not count the drafted tokens before them: wrong, detected."""

    def blind(history: History, block: torch.Tensor) -> History:
        width = block.shape[1] + 1
        return History(
            history.counts.unsqueeze(1).expand(-1, width, -1),
            history.seen.unsqueeze(1).expand(-1, width, -1),
        )

    monkeypatch.setattr(step_module, "block_history", blind)
    option = {"frequency_penalty": 2.0, "presence_penalty": 1.0}
    counts, _ = sample_sequences(pair, **option, **BLOCK)
    expected = exact_sequence_probs(pair.target.model, as_params(option))
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)
    print(f"negative control chi2={stat:.1f} threshold={threshold:.1f}")
    assert stat > threshold, (stat, threshold)


def test_a_penalised_row_stays_exact_in_a_mixed_batch(pair):
    """Rows with and without penalties (and other methods) share every step of the loop."""
    engine = BatchedEngine(pair, BatchLimits(max_num_seqs=16, kv_slots=40))
    option = OPTIONS["all"]
    try:
        handles, fillers = [], []
        for seed in range(NUM_SAMPLES):
            request = pair.prepare(
                PROMPT, max_tokens=LENGTH, seed=seed, log=False, **option, **BLOCK
            )
            handles.append(engine.submit(request))
            if seed % 4 == 0:
                plain = pair.prepare([seed % VOCAB], seed=seed, max_tokens=5, method="token")
                fillers.append(engine.submit(plain))
            if len(handles) % 32 == 0:
                handles[-16].result()
        counts = Counter(tuple(h.result().token_ids) for h in handles)
        for handle in fillers:
            handle.result()
        assert engine.stats.mean_batch > 4, engine.stats.mean_batch
    finally:
        engine.close()
    expected = exact_sequence_probs(pair.target.model, as_params(option))
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)
    print(f"batched chi2={stat:.1f} threshold={threshold:.1f}")
    assert stat < threshold, (stat, threshold)
