"""Monte Carlo through the real engine: emitted 4-token sequences follow the target exactly.

The first token comes from the target at prefill; the next three from speculative steps (k = 2
first), so every verifier decides over more than one drafted token.

Chi-square of the sampled sequences against the target's exact sequence probabilities
(docs/algorithms.md, "Testing exactness"), with a negative control that verifies with a q other than
the one the draft sampled from and must fail the same test.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from osd import SamplingParams, SpeculativeDecoder
from osd.decode import step as engine_module
from osd.decode.sampling import logits_to_probs
from osd.testing import tiny_llama

VOCAB = 4
PROMPT = [1, 2]
LENGTH = 4
NUM_SAMPLES = 3000
CHOICES = 250  # sequences per batch


@pytest.fixture(scope="module")
def mc_engine():
    # Peaked enough that acceptance is about 0.5-0.65: both branches of every verifier run.
    target = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=11, logit_scale=4.0)
    draft = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=13, logit_scale=4.0)
    return SpeculativeDecoder(target, draft)


def exact_sequence_probs(
    target, params: SamplingParams, prompt: list[int] = PROMPT, vocab: int = VOCAB
) -> dict[tuple[int, ...], float]:
    """Every LENGTH-token continuation of ``prompt`` and its probability under ``target``."""
    prefixes = list(itertools.product(range(vocab), repeat=LENGTH - 1))
    ids = torch.tensor([prompt + list(p) for p in prefixes], device=target.device)
    with torch.no_grad():
        logits = target(ids).logits[:, len(prompt) - 1 :].cpu()  # (N, LENGTH, V)
    probs = logits_to_probs(logits.double(), params)
    out = {}
    for row, prefix in enumerate(prefixes):
        for last in range(vocab):
            seq = (*prefix, last)
            out[seq] = math.prod(float(probs[row, i, seq[i]]) for i in range(LENGTH))
    return out


def with_flattened_q(real_verify):
    """The negative control: a verifier handed a q much flatter than the one sampled from."""

    def verify(draft_ids, draft_probs, *args, **kwargs):
        wrong_q = draft_probs**0.2
        wrong_q = wrong_q / wrong_q.sum(-1, keepdim=True).clamp_min(1e-30)
        return real_verify(draft_ids, wrong_q, *args, **kwargs)

    return verify


def chi_square(samples: Counter, expected_probs: dict, num_samples: int) -> tuple[float, float]:
    """Statistic and the threshold df + 10 sqrt(2 df); cells expecting < 5 are pooled."""
    stat, pooled_obs, pooled_exp, bins = 0.0, 0, 0.0, 0
    for seq, prob in expected_probs.items():
        expected = prob * num_samples
        if expected < 5:
            pooled_obs += samples.get(seq, 0)
            pooled_exp += expected
            continue
        stat += (samples.get(seq, 0) - expected) ** 2 / expected
        bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    df = bins - 1
    return stat, df + 10 * math.sqrt(2 * df)


def sample_sequences(engine: SpeculativeDecoder, **kwargs) -> tuple[Counter, float]:
    """NUM_SAMPLES sequences, decoded CHOICES at a time as one request's choices (each with
    streams of its own, sampling its own first token from the shared prompt's logits): the same
    steps and verifiers as one request at a time, about 20 times faster."""
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(0, NUM_SAMPLES, CHOICES):
        for result in engine.generate_choices(
            PROMPT, CHOICES, max_tokens=LENGTH, seed=seed, log=False, **kwargs
        ):
            counts[tuple(result.token_ids)] += 1
            drafted += result.stats.drafted
            accepted += result.stats.accepted
    return counts, accepted / drafted


SETTINGS = [
    pytest.param({"temperature": 1.0}, id="t1"),
    pytest.param({"temperature": 0.8, "top_p": 0.9}, id="t0.8-p0.9"),
]
METHODS = [
    pytest.param({"method": "token", "num_spec_tokens": 2}, id="token"),
    pytest.param({"method": "block", "num_spec_tokens": 2}, id="block"),
    pytest.param({"method": "spectr", "num_spec_tokens": 2, "num_drafts": 3}, id="spectr"),
]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("method", METHODS)
def test_emitted_sequences_follow_target_distribution(mc_engine, setting, method):
    counts, acceptance = sample_sequences(mc_engine, **setting, **method)
    expected = exact_sequence_probs(mc_engine.target.model, SamplingParams(**setting))
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)
    assert 0.2 < acceptance < 0.95, acceptance  # the test exercises both branches
    print(f"chi2={stat:.1f} threshold={threshold:.1f} acceptance={acceptance:.2f}")
    assert stat < threshold, (stat, threshold)


@pytest.mark.parametrize("method", METHODS)
def test_negative_control_verifying_with_wrong_q_fails(mc_engine, method, monkeypatch):
    method_name = method["method"]
    real_verify = engine_module.VERIFIERS[method_name]

    monkeypatch.setitem(engine_module.VERIFIERS, method_name, with_flattened_q(real_verify))
    counts, _ = sample_sequences(mc_engine, temperature=1.0, **method)
    expected = exact_sequence_probs(mc_engine.target.model, SamplingParams())
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)
    print(f"negative control chi2={stat:.1f} threshold={threshold:.1f}")
    assert stat > threshold, (stat, threshold)


def test_adaptive_draft_length_through_engine_is_exact(mc_engine):
    adaptive = SpeculativeDecoder(
        mc_engine.target.model, mc_engine.draft.model, adaptive_threshold=0.5
    )
    counts, _ = sample_sequences(adaptive, temperature=1.0, method="block", num_spec_tokens=3)
    stat, threshold = chi_square(
        counts, exact_sequence_probs(adaptive.target.model, SamplingParams()), NUM_SAMPLES
    )
    assert stat < threshold, (stat, threshold)
    short = adaptive.generate(PROMPT, max_tokens=60, seed=0, num_spec_tokens=3).log.num_drafted
    assert int(short.min()) < 3  # drafting did stop early
