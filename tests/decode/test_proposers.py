"""The proposers through the real engine: looked-up drafts keep every method exact, in batches
beside the draft model's rows; a step without a draft-model row runs no draft forward; the
controller picks a lookup where it pays; requests pin a proposer.

The Monte Carlo follows ``tests/decode/test_monte_carlo.py``: every sequence's exact probability
by enumeration, a chi-square over samples, and a negative control that must fail: a verifier
told the looked-up tokens were drawn from a uniform q instead of chosen (q one-hot).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from osd import SamplingParams, SpeculativeDecoder
from osd.decode import step as step_module
from osd.decode.goodput import GoodputController
from osd.decode.loop import BatchedEngine
from osd.decode.proposers import LookupBackoff, LookupYield
from osd.decode.scheduler import BatchLimits
from osd.errors import ParamError
from osd.testing import char_tokenizer, noisy_copy, tiny_llama, with_lora_adapters
from tests.decode.test_batched_engine import CheapDraftCosts
from tests.decode.test_monte_carlo import LENGTH, VOCAB, chi_square, exact_sequence_probs

# A prompt that repeats itself, so the row's own tokens (ngram) propose from the first step.
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
NUM_SAMPLES = 2400


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=11, logit_scale=4.0)
    draft = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=13, logit_scale=4.0)
    return target, with_lora_adapters(draft, ["a"], seed=5)


@pytest.fixture(scope="module")
def mc(pair):
    decoder = SpeculativeDecoder(*pair, suffix_budget=4096)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=16, kv_slots=40))
    engine.controller.costs = CheapDraftCosts()  # type: ignore[assignment]
    yield decoder, engine
    engine.close()


def sample(decoder, engine, **kwargs) -> tuple[Counter, Counter]:
    """NUM_SAMPLES sequences of PROMPT, with draft-model rows (other prompts, adapters,
    temperatures) sharing the steps; returns the sequences and the drafted/accepted counts
    per proposer."""
    handles, neighbours = [], []
    for seed in range(NUM_SAMPLES):
        request = decoder.prepare(PROMPT, max_tokens=LENGTH, seed=seed, log=False, **kwargs)
        handles.append(engine.submit(request))
        if seed % 4 == 0:
            neighbour = decoder.prepare(
                [seed % VOCAB, 1],
                seed=seed,
                max_tokens=5,
                method="block",
                adapter="a",
                proposer="draft",
                temperature=0.7,
            )
            neighbours.append(engine.submit(neighbour))
        if len(handles) % 32 == 0:
            handles[-16].result()
    counts: Counter = Counter()
    mix: Counter = Counter()
    for handle in handles:
        result = handle.result()
        counts[tuple(result.token_ids)] += 1
        for name, (_, drafted, accepted) in result.stats.by_proposer.items():
            mix[name, "drafted"] += drafted
            mix[name, "accepted"] += accepted
    drafted_by_model = sum(h.result().stats.by_proposer.get("draft", [0, 0])[1] for h in neighbours)
    assert drafted_by_model > 0  # the model's rows drafted beside the lookups
    return counts, mix


CASES = [
    pytest.param(
        {"proposer": "suffix", "method": "token", "num_spec_tokens": 3}, id="suffix-token"
    ),
    pytest.param(
        {"proposer": "suffix", "method": "block", "num_spec_tokens": 3}, id="suffix-block"
    ),
    pytest.param({"proposer": "ngram", "method": "block", "num_spec_tokens": 3}, id="ngram-block"),
    pytest.param({"proposer": "auto", "method": "token", "num_spec_tokens": "auto"}, id="auto"),
]


@pytest.mark.parametrize("case", CASES)
def test_looked_up_drafts_keep_the_target_distribution(mc, case):
    decoder, engine = mc
    counts, mix = sample(decoder, engine, temperature=0.9, **case)
    expected = exact_sequence_probs(decoder.target.model, SamplingParams(0.9), prompt=PROMPT)
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)
    name = "ngram" if case["proposer"] == "ngram" else "suffix"
    drafted, accepted = mix[name, "drafted"], mix[name, "accepted"]
    print(f"chi2={stat:.1f} threshold={threshold:.1f} {name}: {accepted}/{drafted} {dict(mix)}")
    # Pinned, the lookups draft most steps; under "auto" the controller rightly prefers this
    # pair's draft (it accepts 0.7, the lookups 0.25) and the lookups draft some steps.
    assert drafted > (100 if case["proposer"] == "auto" else NUM_SAMPLES // 2), mix
    assert 0.1 < accepted / drafted < 0.95, mix  # both branches of the verifier ran
    assert stat < threshold, (stat, threshold)


def with_uniform_q(real_verify):
    """The negative control: one-hot q (a looked-up draft) replaced by a uniform one."""

    def verify(draft_ids, draft_probs, *args, **kwargs):
        one_hot = draft_probs.amax(-1, keepdim=True) >= 1
        uniform = torch.full_like(draft_probs, 1.0 / draft_probs.shape[-1])
        return real_verify(draft_ids, torch.where(one_hot, uniform, draft_probs), *args, **kwargs)

    return verify


@pytest.mark.parametrize("case", CASES[:2])
def test_negative_control_fails(mc, case, monkeypatch):
    decoder, engine = mc
    name = case["method"]
    monkeypatch.setitem(step_module.VERIFIERS, name, with_uniform_q(step_module.VERIFIERS[name]))
    counts, _ = sample(decoder, engine, temperature=0.9, **case)
    expected = exact_sequence_probs(decoder.target.model, SamplingParams(0.9), prompt=PROMPT)
    stat, threshold = chi_square(counts, expected, NUM_SAMPLES)
    print(f"negative control chi2={stat:.1f} threshold={threshold:.1f}")
    assert stat > threshold, (stat, threshold)


@pytest.fixture(scope="module")
def text_decoder():
    target = tiny_llama(vocab_size=64, hidden_size=64, num_layers=2, seed=0, logit_scale=4.0)
    draft = with_lora_adapters(noisy_copy(target, 0.3, seed=1), ["code"], seed=2)
    return SpeculativeDecoder(target, draft, char_tokenizer(), suffix_budget=10_000)


@pytest.mark.parametrize("proposer", ["auto", "draft", "suffix", "ngram"])
@pytest.mark.parametrize("method", ["token", "block", "spectr"])
def test_greedy_output_is_the_targets_with_every_proposer(text_decoder, proposer, method):
    prompt = "select a, b from t where a = 1; select a, b from t where"
    alone = text_decoder.generate(prompt, max_tokens=30, temperature=0, method="none")
    for _ in range(2):  # the second time, suffix finds the first answer
        result = text_decoder.generate(
            prompt, max_tokens=30, temperature=0, method=method, proposer=proposer
        )
        assert result.token_ids == alone.token_ids
    looked_up = "suffix" if proposer == "auto" else proposer
    assert set(result.stats.by_proposer) <= {"draft", looked_up}


def test_a_batch_of_lookups_runs_no_draft_forward(text_decoder, monkeypatch):
    engine = BatchedEngine(text_decoder, BatchLimits(max_num_seqs=8))
    calls = []
    real_propose = step_module.propose

    def counting(pair, rows, sampling, history, spec_k, *args, **kwargs):
        calls.append(list(spec_k))
        return real_propose(pair, rows, sampling, history, spec_k, *args, **kwargs)

    monkeypatch.setattr(step_module, "propose", counting)
    forwards = []
    real_run = step_module.run_model  # the draft's forwards go through drafting's run_model
    monkeypatch.setattr(
        "osd.decode.drafting.run_model",
        lambda pair, model, *a, **k: forwards.append(model) or real_run(pair, model, *a, **k),
    )
    try:
        prompt = "abc abc abc abc abc abc abc"
        handles = [
            engine.submit(
                text_decoder.prepare(prompt, max_tokens=12, temperature=0, proposer="ngram")
            )
            for _ in range(4)
        ]
        results = [h.result() for h in handles]
    finally:
        engine.close()
    assert all(r.stats.by_proposer.get("ngram", [0, 0])[1] > 0 for r in results)
    assert all(not any(k) for k in calls)  # the draft model had no row at any step
    assert forwards == []


def test_the_controller_takes_a_likely_lookup_and_leaves_an_unlikely_one():
    controller = GoodputController(max_k=4)
    controller.costs = CheapDraftCosts()  # type: ignore[assignment]
    likely = ("suffix", (1.0, 1.0, 0.9, 0.9))
    assert controller.choose_proposer("base", "", 1, 4, [likely]) == ("suffix", 4)
    for _ in range(50):  # the draft accepts everything: four tokens for 1.2 steps
        controller.observe_row("base", "", 4, 4)
    unlikely = ("suffix", (0.15,))
    name, k = controller.choose_proposer("base", "", 1, 4, [unlikely])
    assert name == "draft" and k >= 3
    for _ in range(50):  # the lookups' probabilities turn out too high: calibrated down
        controller.observe_free("suffix", "", 2.0, 0)
    assert controller.choose_proposer("base", "", 1, 4, [likely])[0] == "draft"
    assert controller.choose_proposer("base", "", 1, 4, []) == ("draft", k)


def test_a_lookup_under_auto_k_has_its_own_cap_above_the_draft_models():
    """A looked-up draft costs no draft forward: under "auto" k it may verify up to
    ``max_lookup_tokens`` (free_limit), while the draft model keeps ``max_spec_tokens``."""
    controller = GoodputController(max_k=4)
    controller.costs = CheapDraftCosts()  # type: ignore[assignment]
    sure = ("suffix", (1.0,) * 12)
    assert controller.choose_proposer("base", "", 1, 4, [sure], 12) == ("suffix", 12)
    assert controller.choose_proposer("base", "", 1, 4, [sure]) == ("suffix", 4)  # no cap: k's
    assert controller.choose_proposer("base", "", 1, 4, [], 12)[1] <= 4  # the draft model's
    for _ in range(50):  # the draft accepts everything: it beats an unlikely lookup ...
        controller.observe_row("base", "", 4, 4)
    name, k = controller.choose_proposer("base", "", 1, 4, [("suffix", (0.15,) * 12)], 12)
    assert name == "draft" and 1 <= k <= 4  # ... at its own cap, not the lookups


def test_an_answer_asked_again_is_replayed_past_the_draft_models_k_and_stays_exact(
    text_decoder,
):
    wide = SpeculativeDecoder(
        text_decoder.target.model,
        text_decoder.draft.model,
        char_tokenizer(),
        suffix_budget=10_000,
        max_spec_tokens=4,
        max_lookup_tokens=12,
    )
    prompt = "select a, b from t where a = 1; select c from u where"
    alone = wide.generate(prompt, max_tokens=40, temperature=0, method="none")
    wide.generate(prompt, max_tokens=40, temperature=0)  # the suffix store learns the answer
    again = wide.generate(prompt, max_tokens=40, temperature=0)
    assert again.token_ids == alone.token_ids
    stats = again.stats
    looked_up = [
        n for n, p in zip(stats.draft_lengths, stats.step_proposers, strict=True) if p == "suffix"
    ]
    drafted = [
        n for n, p in zip(stats.draft_lengths, stats.step_proposers, strict=True) if p == "draft"
    ]
    assert looked_up and max(looked_up) > 4  # past the draft model's k ...
    assert max(looked_up) <= 12 and max(drafted, default=0) <= 4  # ... within each cap
    assert stats.steps < 40 / 4  # fewer steps than k = 4 could take
    # A fixed k is the request's, for lookups too.
    fixed = wide.generate(
        prompt, max_tokens=40, temperature=0, num_spec_tokens=3, proposer="suffix"
    )
    assert fixed.token_ids == alone.token_ids and max(fixed.stats.draft_lengths) <= 3
    with pytest.raises(ValueError, match="max_lookup_tokens"):
        SpeculativeDecoder(
            text_decoder.target.model,
            text_decoder.draft.model,
            char_tokenizer(),
            max_lookup_tokens=0,
        )


def test_a_pinned_proposer_is_checked_and_reported(text_decoder):
    with pytest.raises(ParamError) as raised:
        text_decoder.prepare("abc", proposer="eagle")
    assert raised.value.param == "proposer"
    plain = SpeculativeDecoder(
        text_decoder.target.model, text_decoder.draft.model, char_tokenizer(), proposers=False
    )
    result = plain.generate("abc abc abc abc", max_tokens=8, temperature=0, proposer="suffix")
    assert set(result.stats.by_proposer) <= {"draft"}  # no lookups: the model drafts


def test_rows_the_draft_model_never_drafts_for_never_run_it_not_even_on_their_prompts(
    text_decoder, monkeypatch
):
    """Speculation that does not use the draft model costs what the target alone costs: no
    draft forward at any step and no draft prefill (the draft reads a prompt only when it
    first drafts for the row)."""
    read = []
    real_run = text_decoder.draft.run
    monkeypatch.setattr(
        text_decoder.draft,
        "run",
        lambda plan, cache, **kw: read.append(1) or real_run(plan, cache, **kw),
    )
    engine = BatchedEngine(text_decoder, BatchLimits(max_num_seqs=8))
    try:
        prompt = "abc abc abc abc abc abc abc"
        lookups = [
            engine.submit(
                text_decoder.prepare(prompt, max_tokens=12, temperature=0, proposer="ngram")
            )
            for _ in range(3)
        ]
        alone = engine.submit(text_decoder.prepare(prompt, max_tokens=12, method="none"))
        results = [h.result() for h in [*lookups, alone]]
    finally:
        engine.close()
    assert all(r.stats.by_proposer.get("ngram", [0, 0])[1] > 0 for r in results[:3])
    assert read == []


def test_a_row_far_behind_catches_the_draft_up_in_its_own_forward(text_decoder, monkeypatch):
    """A long prompt beside short ones: the draft reads it in a forward of its own before the
    step's first draft forward, and every row's greedy output is the target's."""
    from osd.decode import drafting

    caught = []
    real_catch_up = drafting._catch_up
    monkeypatch.setattr(
        drafting,
        "_catch_up",
        lambda pair, rows: (
            caught.append([len(r.seq) - r.draft_len for r in rows]) or real_catch_up(pair, rows)
        ),
    )
    prompts = ["ab", "select a, b from t where a = 1; select a, b from t where", "ba"]
    alone = [text_decoder.generate(p, max_tokens=16, temperature=0, method="none") for p in prompts]
    engine = BatchedEngine(text_decoder, BatchLimits(max_num_seqs=8))
    try:
        handles = [
            engine.submit(
                text_decoder.prepare(
                    p, max_tokens=16, temperature=0, method="block", proposer="draft"
                )
            )
            for p in prompts
        ]
        results = [h.result() for h in handles]
    finally:
        engine.close()
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    assert any(gaps and max(gaps) > drafting.CATCH_UP_TOKENS for gaps in caught)


def test_lookup_backoff_halves_its_lookups_while_they_give_no_draft():
    backoff = LookupBackoff()
    due = []
    for step in range(40):
        if backoff.due(step):
            due.append(step)
            backoff.update(drafted=False, step=step)
    assert due == [0, 1, 3, 7, 15, 23, 31, 39]  # gaps 1, 2, 4, 8, then 8 (max_gap)
    backoff.update(drafted=True, step=40)  # a draft: looked up again at the next step
    assert backoff.due(41) and backoff.misses == 0


def test_an_auto_row_whose_lookups_find_nothing_looks_up_less_often(text_decoder, monkeypatch):
    """Lookups cost the decode thread at every step; a row whose lookups give nothing backs
    off (LookupBackoff), and its output stays the target's."""
    offered = []
    monkeypatch.setattr(
        "osd.decode.proposers.lookup.LookupProposer.offer",
        lambda self, row, limit: offered.append(row.step) and None,
    )
    # Whatever the module's decoder learnt in the tests before from measured seconds (a row
    # skips lookups that could not pay, and every row skips them while drafting at its batch
    # size is held off: both tested in test_goodput.py; on a loaded CI machine the hold
    # took every lookup of this test), the backoff's rhythm is what is counted here.
    monkeypatch.setattr(
        "osd.decode.goodput.GoodputController.lookups_could_pay", lambda self, *args: True
    )
    monkeypatch.setattr("osd.decode.goodput.GoodputController.wants_lookups", lambda self, b: True)
    prompt = "the quick brown fox jumps over the lazy dog"
    alone = text_decoder.generate(prompt, max_tokens=40, temperature=0, method="none")
    result = text_decoder.generate(prompt, max_tokens=40, temperature=0, proposer="auto")
    assert result.token_ids == alone.token_ids
    assert 0 < len(offered) <= 12  # of ~40 steps: at steps 0, 1, 3, 7, 15, then every 8


def test_rows_of_a_route_whose_lookups_never_draft_start_backed_off():
    route = LookupYield()
    misses = 0
    while not route.cold:
        route.add(drafted=False)
        misses += 1
    assert 50 <= misses <= 60  # judged once 50 recent lookups' worth are seen
    cold = LookupBackoff(max_gap=32, misses=4)
    due = [step for step in range(64) if cold.due(step) and not cold.update(False, step)]
    assert due == [0, 16, 48]  # against 11 lookups in 64 steps for a row of a warm route
    for _ in range(10):
        route.add(drafted=True)
    assert not route.cold  # lookups that draft warm the route again


def test_an_adapter_with_the_base_drafts_weights_counts_toward_the_base_drafts_acceptance(pair):
    """Serving's version 0 of every adapter is the base draft (LoRA's B at zero): one curve, so
    a cold replica's untrained adapters are not each tried at the optimistic prior in turn."""
    decoder = SpeculativeDecoder(*pair)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4, kv_slots=8))
    try:
        for base_weights in (True, False):
            request = decoder.prepare(PROMPT, max_tokens=8, seed=1, adapter="a", log=False)
            request = dataclasses.replace(request, base_weights=base_weights)
            engine.submit(request).result()
        assert {adapter for adapter, _ in engine.controller.curves} == {"base", "a"}
    finally:
        engine.close()


def test_rows_with_the_base_drafts_weights_draft_without_their_adapter(pair, monkeypatch):
    """Their LoRA adds exactly zero (B at zero) at the cost of its layers: the bare draft runs."""
    from osd.decode import drafting

    seen: list[list[str | None]] = []
    real = drafting.run_model

    def spy(*args, **kwargs):
        seen.append(list(kwargs["adapters"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(drafting, "run_model", spy)
    decoder = SpeculativeDecoder(*pair)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4, kv_slots=8))
    try:
        for base_weights in (True, False):
            request = decoder.prepare(
                PROMPT, max_tokens=8, seed=1, adapter="a", num_spec_tokens=2, log=False
            )
            engine.submit(dataclasses.replace(request, base_weights=base_weights)).result()
            assert seen and all(a == [None if base_weights else "a"] for a in seen)
            seen.clear()
    finally:
        engine.close()
