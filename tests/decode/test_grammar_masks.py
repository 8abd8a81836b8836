"""Structured output keeps every method exact: the output follows the target's distribution
restricted to the grammar and renormalised at each token (osd.decode.grammar,
osd.decode.grammar_masks).

A regular expression whose next allowed tokens depend on the tokens before it (after ``c`` only
``a``; end-of-sequence only where the output is complete), on a 5-token vocabulary, so the
masks of a drafted block differ position by position. The exact distribution of every output
is enumerated from the target; the engine's samples must pass the chi-square of
``tests/decode/test_monte_carlo.py`` for each method, alone and in a batch with other rows, and a
negative control (the verifier handed a q other than the masked one sampled from: uniform over
the allowed tokens) must fail.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest
import torch

from osd import SpeculativeDecoder
from osd.decode import step as step_module
from osd.decode.loop import BatchedEngine
from osd.decode.sampling import SamplingParams, logits_to_probs
from osd.decode.scheduler import BatchLimits
from osd.testing import char_tokenizer, noisy_copy, tiny_llama
from tests.decode.test_monte_carlo import chi_square

PATTERN = "[ab](ca|b)*"
VOCAB = 5  # <pad> <eos> a b c
EOS = 1
PROMPT = [2, 3]
LENGTH = 4
NUM_SAMPLES = 3000
BATCHED_SAMPLES = 1500


@pytest.fixture(scope="module")
def decoder():
    # Peaked enough that acceptance is about 0.5-0.7: both branches of every verifier run.
    target = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=11, logit_scale=3.0)
    draft = tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=13, logit_scale=3.0)
    return SpeculativeDecoder(target, draft, char_tokenizer("abc"))


def exact_output_probs(decoder: SpeculativeDecoder, temperature: float) -> dict[tuple, float]:
    """Every output's probability under the grammar-restricted target, by enumeration."""
    grammar = decoder.grammars.compile("regex", PATTERN)
    out: dict[tuple, float] = {}

    def visit(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == LENGTH or (prefix and prefix[-1] == EOS):
            out[prefix] = prob
            return
        matcher = grammar.matcher()
        assert matcher.consume_tokens(list(prefix))
        allowed = torch.tensor(
            [bool(matcher.validate_tokens([t])) for t in range(VOCAB)], dtype=torch.bool
        )
        with torch.no_grad():
            model = decoder.target.model
            ids = torch.tensor([PROMPT + list(prefix)], device=model.device)
            logits = model(ids).logits[0, -1].cpu()
        masked = logits.double().masked_fill(~allowed, float("-inf"))
        probs = logits_to_probs(masked, SamplingParams(temperature=temperature))
        for token in range(VOCAB):
            if probs[token] > 0:
                visit((*prefix, token), prob * float(probs[token]))

    visit((), 1.0)
    assert math.isclose(sum(out.values()), 1.0, rel_tol=1e-9)
    return out


def sample_outputs(
    decoder, submit, num_samples: int = NUM_SAMPLES, **kwargs
) -> tuple[Counter, float]:
    grammar = decoder.grammars.compile("regex", PATTERN)
    counts: Counter = Counter()
    drafted = accepted = 0
    for result in submit(
        [
            decoder.prepare(
                PROMPT, max_tokens=LENGTH, seed=seed, log=False, grammar=grammar, **kwargs
            )
            for seed in range(num_samples)
        ]
    ):
        counts[tuple(result.token_ids)] += 1
        drafted += result.stats.drafted
        accepted += result.stats.accepted
        text = result.text
        assert re.fullmatch(PATTERN, text) or len(result.token_ids) == LENGTH, text
    return counts, accepted / max(drafted, 1)


def alone(decoder):
    """Each request on its own, but many at once: a batched loop as wide as the requests that
    fit, with nothing else in it (one request at a time took about 20 times longer)."""

    def submit(requests):
        engine = BatchedEngine(
            decoder, BatchLimits(max_num_seqs=256, kv_slots=512, max_waiting=len(requests))
        )
        try:
            handles = [engine.submit(r) for r in requests]
            return [h.result() for h in handles]
        finally:
            engine.close()

    return submit


METHODS = [
    pytest.param({"method": "block", "num_spec_tokens": 3}, id="block"),
]  # token shares block's masks; spectr (a matcher copy per branch): in the batched test below


@pytest.mark.parametrize("method", METHODS)
def test_constrained_outputs_follow_restricted_target(decoder, method):
    counts, acceptance = sample_outputs(decoder, alone(decoder), temperature=0.9, **method)
    stat, threshold = chi_square(counts, exact_output_probs(decoder, 0.9), NUM_SAMPLES)
    print(f"chi2={stat:.1f} threshold={threshold:.1f} acceptance={acceptance:.2f}")
    assert 0.2 < acceptance < 0.95, acceptance
    assert stat < threshold, (stat, threshold)


def test_constrained_rows_exact_in_a_batch_with_free_rows(decoder):
    """Grammar rows beside free rows (other methods, temperatures) in the batched loop."""
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=16, kv_slots=48))
    try:

        def submit(requests):
            handles, free = [], []
            for i, request in enumerate(requests):
                handles.append(engine.submit(request))
                if i % 4 == 0:
                    neighbour = decoder.prepare([2], seed=i, max_tokens=5, method="block")
                    free.append(engine.submit(neighbour))
                if len(handles) % 32 == 0:
                    handles[-16].result()
            yield from (h.result() for h in handles)
            for h in free:
                assert h.result().finish_reason in ("stop", "length")

        # Fewer samples: the batched loop is several times slower per request on these
        # tiny models; the alone tests above carry the power.
        counts, _ = sample_outputs(
            decoder,
            submit,
            BATCHED_SAMPLES,
            temperature=1.0,
            method="spectr",
            num_spec_tokens=3,
            num_drafts=2,
        )
    finally:
        engine.close()
    stat, threshold = chi_square(counts, exact_output_probs(decoder, 1.0), BATCHED_SAMPLES)
    print(f"chi2={stat:.1f} threshold={threshold:.1f}")
    assert stat < threshold, (stat, threshold)


def with_uniform_allowed_q(real_verify):
    """The negative control: a verifier handed, for q, the uniform distribution over the
    tokens the grammar allows (the mask right, the draft's own probabilities lost)."""

    def verify(draft_ids, draft_probs, *args, **kwargs):
        allowed = (draft_probs > 0).to(draft_probs.dtype)
        wrong_q = allowed / allowed.sum(-1, keepdim=True).clamp_min(1)
        return real_verify(draft_ids, wrong_q, *args, **kwargs)

    return verify


def test_negative_control_fails(decoder, monkeypatch):
    monkeypatch.setitem(
        step_module.VERIFIERS, "block", with_uniform_allowed_q(step_module.VERIFIERS["block"])
    )
    counts, _ = sample_outputs(
        decoder, alone(decoder), temperature=1.0, method="block", num_spec_tokens=3
    )
    stat, threshold = chi_square(counts, exact_output_probs(decoder, 1.0), NUM_SAMPLES)
    print(f"negative control chi2={stat:.1f} threshold={threshold:.1f}")
    assert stat > threshold, (stat, threshold)


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "kind": {"enum": ["sql", "json", "py"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def char_decoder():
    target = tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=3, logit_scale=2.0)
    draft = tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=4, logit_scale=2.0)
    return SpeculativeDecoder(target, draft, char_tokenizer())


@pytest.mark.parametrize("method", ["token", "block", "spectr"])
def test_greedy_schema_output_equals_target_alone(char_decoder, method):
    """Greedy: speculation under a schema gives the constrained target's own argmax path,
    and the output parses and follows the schema."""
    grammar = char_decoder.grammars.compile("json_schema", SCHEMA)
    options = {"max_tokens": 80, "temperature": 0.0, "grammar": grammar, "log": False}
    reference = char_decoder.generate("go", method="none", **options)
    result = char_decoder.generate("go", method=method, num_spec_tokens=4, **options)
    assert result.token_ids == reference.token_ids
    assert result.finish_reason == "stop"
    assert_follows_schema(json.loads(result.text))


def test_sampled_schema_outputs_parse(char_decoder):
    grammar = char_decoder.grammars.compile("json_schema", json.dumps(SCHEMA))
    engine = BatchedEngine(char_decoder, BatchLimits(max_num_seqs=8, kv_slots=24))
    try:
        handles = [
            engine.submit(
                char_decoder.prepare(
                    "go",
                    max_tokens=80,
                    seed=seed,
                    method=("token", "block", "spectr")[seed % 3],
                    temperature=1.2,
                    grammar=grammar,
                    presence_penalty=0.5,
                )
            )
            for seed in range(12)
        ]
        results = [h.result() for h in handles]
    finally:
        engine.close()
    for result in results:
        assert result.finish_reason == "stop", result.text
        assert_follows_schema(json.loads(result.text))
    assert len({r.text for r in results}) > 1  # sampled, not one path


def assert_follows_schema(value) -> None:
    assert set(value) == {"ok", "kind", "tags"}, value
    assert isinstance(value["ok"], bool)
    assert value["kind"] in ("sql", "json", "py")
    assert len(value["tags"]) <= 2 and set(value["tags"]) <= {"a", "b"}


def test_free_rows_unchanged_beside_grammar_rows(char_decoder):
    """A row without a grammar decodes the same tokens whether or not grammar rows share its
    steps."""
    grammar = char_decoder.grammars.compile("choice", ["yes", "no"])
    free = char_decoder.prepare("abc", max_tokens=20, seed=7, method="block", num_spec_tokens=3)
    engine = BatchedEngine(char_decoder, BatchLimits(max_num_seqs=8, kv_slots=24))
    try:
        alone_ids = engine.submit(free).result().token_ids
        crowd = [
            engine.submit(char_decoder.prepare("q", max_tokens=20, seed=s, grammar=grammar))
            for s in range(4)
        ]
        beside_ids = engine.submit(free).result().token_ids
        answers = [h.result().text for h in crowd]
    finally:
        engine.close()
    assert beside_ids == alone_ids
    assert set(answers) <= {"yes", "no"}


def test_a_grammar_failing_mid_decode_fails_its_request_alone(char_decoder):
    """A grammar that compiles but whose parser gives up on a token (llguidance's resource
    limits) ends its own request with the error; the rows beside it finish normally."""
    grammar = char_decoder.grammars.compile("regex", "a{1000000}")
    engine = BatchedEngine(char_decoder, BatchLimits(max_num_seqs=8, kv_slots=24))
    try:
        free = [
            engine.submit(char_decoder.prepare("abc", max_tokens=12, seed=s, method=m))
            for s, m in ((1, "block"), (2, "spectr"))
        ]
        doomed = engine.submit(char_decoder.prepare("q", max_tokens=12, seed=3, grammar=grammar))
        with pytest.raises(RuntimeError, match="structured output failed"):
            doomed.result()
        assert all(h.result().finish_reason in ("stop", "length") for h in free)
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="structured output failed"):
        char_decoder.generate("q", max_tokens=12, seed=3, grammar=grammar)


@pytest.mark.parametrize("method", ["token", "block", "spectr"])
def test_special_tokens_in_a_grammar_decode_under_speculation(method):
    """A grammar that names special tokens (Mistral's tool-call markers) decodes speculatively
    as without speculation. llguidance 1.9's rollback over a special token reports success and
    leaves the parser elsewhere once masks were computed; the masks draft on copies instead.
    Greedy: the constrained target's own argmax path; written with its special tokens."""
    from tokenizers import AddedToken

    tokenizer = char_tokenizer()
    tokenizer.add_tokens(
        [AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)],
        special_tokens=True,
    )
    target = tiny_llama(vocab_size=66, hidden_size=32, num_layers=1, seed=3, logit_scale=2.0)
    # A draft close to the target: its blocks run past a marker, and are cut back after it.
    decoder = SpeculativeDecoder(target, noisy_copy(target, 0.1, seed=4), tokenizer)
    source = 'start: (<[64]> ("get_weather" | "calc") <[65]> %json {"type": "object"})+'
    grammar = decoder.grammars.compile("lark", source)
    options = {"max_tokens": 60, "temperature": 0.0, "grammar": grammar, "log": False}
    reference = decoder.generate("go", method="none", skip_special_tokens=False, **options)
    result = decoder.generate(
        "go", method=method, num_spec_tokens=4, skip_special_tokens=False, **options
    )
    assert result.token_ids == reference.token_ids
    assert re.fullmatch(r"(\[TOOL_CALLS\](get_weather|calc)\[ARGS\]\{.*?\})+.*", result.text)
    assert decoder.generate("go", method=method, num_spec_tokens=4, **options).text == (
        result.text.replace("[TOOL_CALLS]", "").replace("[ARGS]", "")
    )
