"""Monte Carlo through the batched loop: a row's emitted sequences follow the target exactly
while other rows (other adapters, temperatures, methods and lengths) share every step.

Same chi-square and negative control as ``tests/decode/test_monte_carlo.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest

from osd import SamplingParams, SpeculativeDecoder
from osd.decode import step as step_module
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits
from osd.testing import tiny_llama, with_lora_adapters
from tests.decode.test_batched_engine import CheapDraftCosts
from tests.decode.test_monte_carlo import (
    LENGTH,
    NUM_SAMPLES,
    PROMPT,
    VOCAB,
    chi_square,
    exact_sequence_probs,
    with_flattened_q,
)

NEIGHBOURS = [
    {"temperature": 0.5, "method": "block", "adapter": "a", "max_tokens": 7},
    {"temperature": 0.0, "method": "spectr", "adapter": None, "max_tokens": 5},
    {"temperature": 1.3, "method": "none", "adapter": "b", "max_tokens": 4, "top_k": 3},
]


@pytest.fixture(scope="module")
def mc_batched():
    target = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=11, logit_scale=4.0)
    draft = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=13, logit_scale=4.0)
    draft = with_lora_adapters(draft, ["a", "b"], seed=5)
    decoder = SpeculativeDecoder(target, draft)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=16, kv_slots=40))
    # "auto" rows must draft for the test to have power: costs of a pair whose draft is cheap
    # (this tiny draft costs as much as its target, where the controller rightly drafts nothing).
    engine.controller.costs = CheapDraftCosts()  # type: ignore[assignment]
    yield decoder, engine
    engine.close()


def sample_batched(decoder, engine, **kwargs) -> tuple[Counter, float]:
    handles, fillers = [], []
    for seed in range(NUM_SAMPLES):
        adapter = ("a", None, "b")[seed % 3]
        request = decoder.prepare(
            PROMPT, max_tokens=LENGTH, seed=seed, log=False, adapter=adapter, **kwargs
        )
        handles.append(engine.submit(request))
        if seed % 5 == 0:
            neighbour = NEIGHBOURS[seed % len(NEIGHBOURS)]
            fillers.append(engine.submit(decoder.prepare([seed % VOCAB], seed=seed, **neighbour)))
        if len(handles) % 32 == 0:  # keep the waiting queue bounded
            handles[-16].result()
    counts: Counter = Counter()
    drafted = accepted = 0
    for handle in handles:
        result = handle.result()
        counts[tuple(result.token_ids)] += 1
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    for handle in fillers:
        handle.result()
    assert engine.stats.mean_batch > 4, engine.stats.mean_batch
    return counts, accepted / drafted


METHODS = [
    pytest.param({"method": "token", "num_spec_tokens": 2}, id="token"),
    pytest.param({"method": "block", "num_spec_tokens": 2}, id="block"),
    pytest.param({"method": "spectr", "num_spec_tokens": 2, "num_drafts": 3}, id="spectr"),
    pytest.param({"method": "block", "num_spec_tokens": "auto"}, id="block-auto"),
]


@pytest.mark.parametrize("method", METHODS)
def test_batched_rows_follow_target_distribution(mc_batched, method):
    decoder, engine = mc_batched
    counts, acceptance = sample_batched(decoder, engine, temperature=0.9, top_p=0.95, **method)
    expected = exact_sequence_probs(decoder.target.model, SamplingParams(0.9, 0.95))
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)
    print(f"chi2={stat:.1f} threshold={threshold:.1f} acceptance={acceptance:.2f}")
    assert 0.2 < acceptance < 0.95, acceptance  # both branches of every verifier run
    assert stat < threshold, (stat, threshold)


@pytest.mark.parametrize("method", METHODS)
def test_batched_negative_control_fails(mc_batched, method, monkeypatch):
    decoder, engine = mc_batched
    name = method["method"]
    real_verify = step_module.VERIFIERS[name]

    monkeypatch.setitem(step_module.VERIFIERS, name, with_flattened_q(real_verify))
    counts, _ = sample_batched(decoder, engine, temperature=1.0, **method)
    expected = exact_sequence_probs(decoder.target.model, SamplingParams())
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)
    print(f"negative control chi2={stat:.1f} threshold={threshold:.1f}")
    assert stat > threshold, (stat, threshold)
