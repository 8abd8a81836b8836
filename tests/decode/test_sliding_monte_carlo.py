"""Monte Carlo on a sliding-window family: emitted sequences follow the target exactly.

A Mistral target and draft with a window of 3 tokens and a 6-token prompt: every emitted token
is decided by layers that must not see the start of the prompt. The exact sequence
probabilities come from the target's own forward (transformers' sliding-window masks). Two
controls must fail: verifying with a q other than the one sampled from, and serving the model
as if its layers had no window (what the engine did before it knew of windows).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from osd import SamplingParams, SpeculativeDecoder
from osd.decode import step as step_module
from osd.decode.attention import AttentionLayout
from tests.decode.test_monte_carlo import (
    CHOICES,
    LENGTH,
    NUM_SAMPLES,
    chi_square,
    exact_sequence_probs,
    with_flattened_q,
)

VOCAB, WINDOW = 4, 3
PROMPT = [1, 2, 3, 0, 1, 2]


def tiny_mistral(seed: int) -> transformers.MistralForCausalLM:
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=WINDOW,
        max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.MistralForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def sliding_engine():
    return SpeculativeDecoder(tiny_mistral(13), tiny_mistral(15))


def exact_probs(target) -> dict[tuple[int, ...], float]:
    return exact_sequence_probs(target, SamplingParams(), PROMPT, VOCAB)


def sample(
    engine: SpeculativeDecoder, num_samples: int = NUM_SAMPLES, **kwargs
) -> tuple[dict, float]:
    counts: dict[tuple[int, ...], int] = {}
    drafted = accepted = 0
    for seed in range(0, num_samples, CHOICES):
        for result in engine.generate_choices(
            PROMPT, CHOICES, max_tokens=LENGTH, seed=seed, log=False, **kwargs
        ):
            key = tuple(result.token_ids)
            counts[key] = counts.get(key, 0) + 1
            drafted += result.stats.drafted
            accepted += result.stats.accepted
    return counts, accepted / max(drafted, 1)


METHODS = [
    pytest.param({"method": "token", "num_spec_tokens": 2}, id="token"),
    pytest.param({"method": "block", "num_spec_tokens": 3}, id="block"),
    pytest.param({"method": "spectr", "num_spec_tokens": 2, "num_drafts": 3}, id="spectr"),
]


@pytest.mark.parametrize("method", METHODS)
def test_sliding_window_sequences_follow_the_target(sliding_engine, method):
    counts, acceptance = sample(sliding_engine, temperature=1.0, **method)
    expected = exact_probs(sliding_engine.target.model)
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)  # type: ignore[arg-type]
    print(f"chi2={stat:.1f} threshold={threshold:.1f} acceptance={acceptance:.2f}")
    assert 0.2 < acceptance < 0.95, acceptance
    assert stat < threshold, (stat, threshold)


def test_negative_control_a_wrong_q_fails(sliding_engine, monkeypatch):
    monkeypatch.setitem(
        step_module.VERIFIERS, "block", with_flattened_q(step_module.VERIFIERS["block"])
    )
    counts, _ = sample(sliding_engine, temperature=1.0, method="block", num_spec_tokens=3)
    expected = exact_probs(sliding_engine.target.model)
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)  # type: ignore[arg-type]
    print(f"negative control chi2={stat:.1f} threshold={threshold:.1f}")
    assert stat > threshold, (stat, threshold)


def test_negative_control_ignoring_the_window_fails(sliding_engine, monkeypatch):
    for lm in (sliding_engine.target, sliding_engine.draft):
        monkeypatch.setattr(lm, "attention", AttentionLayout.full())
    # The window changes each position's distribution by 0.04 in total variation on average
    # (0.16 at most): three times the samples give the test its power.
    counts, _ = sample(sliding_engine, 3 * NUM_SAMPLES, temperature=1.0, method="none")
    expected = exact_probs(sliding_engine.target.model)
    stat, threshold = chi_square(counts, expected, 3 * NUM_SAMPLES)  # type: ignore[arg-type]
    print(f"window ignored: chi2={stat:.1f} threshold={threshold:.1f}")
    assert stat > threshold, (stat, threshold)
