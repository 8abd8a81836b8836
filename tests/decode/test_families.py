"""The family matrix: every verifier is exact on every model family the engine serves.

Tiny random target/draft pairs of each family (tests/families.py) decode well past their
sliding windows and attention chunks; greedy output must equal the target's own ``generate``
(transformers' masks and caches), alone and in a mixed batch with per-row LoRA adapters, in
float32; in bfloat16 speculation must equal the target alone through the same loop, or flip
only at a near-tie of the target's logits.
"""

from __future__ import annotations

import pytest
import torch

from osd import SpeculativeDecoder
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits
from tests.families import FAMILIES, WINDOW, WINDOWED, family_pair

# Prompts longer than the windows (8), outputs 4x a window: every layer kind is exercised.
PROMPTS = [[3, 5, 7, 9, 11, 13, 2, 4, 6, 8], list(range(20, 40))]
LENGTH = 32
METHODS = ["none", "token", "block", "spectr"]
# (method, adapter, k, prompt, max_tokens): six rows of one batch, each its own settings.
MIXED = [
    ("block", "code", 4, 0, LENGTH),
    ("token", "sql", 3, 1, 24),
    ("spectr", None, 3, 0, 28),
    ("none", "code", 4, 1, LENGTH),
    ("block", None, "auto", 1, 30),
    ("spectr", "sql", 2, 0, 20),
]


def greedy(decoder: SpeculativeDecoder, prompt: list[int], method: str) -> tuple[list[int], int]:
    """The decoder's greedy tokens with the ``code`` adapter, and how many drafts it accepted."""
    result = decoder.generate(
        prompt,
        max_tokens=LENGTH,
        temperature=0,
        method=method,
        adapter="code",
        num_spec_tokens=4,
        num_drafts=3,
        stop_token_ids=[],
    )
    return result.token_ids, result.stats.accepted


def target_greedy(target, prompt: list[int], length: int) -> list[int]:
    out = target.generate(
        torch.tensor([prompt]), max_new_tokens=length, min_new_tokens=length, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(name, target, decoder) of one family, float32."""
    target, draft = family_pair(request.param)
    return request.param, target, SpeculativeDecoder(target, draft)


def test_every_family_passes_its_windows(family):
    name, target, decoder = family
    window = decoder.target.attention.max_window
    assert (window == WINDOW) if name in WINDOWED else window is None, decoder.target.attention
    assert len(PROMPTS[0]) + LENGTH > 4 * WINDOW


def test_greedy_output_equals_generate_for_every_method(family):
    _, target, decoder = family
    accepted = 0
    for prompt in PROMPTS:
        reference = target_greedy(target, prompt, LENGTH)
        for method in METHODS:
            tokens, num_accepted = greedy(decoder, prompt, method)
            assert tokens == reference, method
            accepted += num_accepted
    assert accepted > 0  # rows were cut back after partial acceptances, not only rejections


def decode_batch(engine: BatchedEngine, decoder: SpeculativeDecoder, runs: list) -> list:
    """Greedy results of ``runs`` ((method, adapter, k, prompt, max_tokens) each), submitted
    together; closes the engine."""
    try:
        handles = [
            engine.submit(
                decoder.prepare(
                    PROMPTS[p],
                    max_tokens=n,
                    temperature=0,
                    method=method,
                    adapter=adapter,
                    num_spec_tokens=k,
                    num_drafts=3,
                    stop_token_ids=[],
                )
            )
            for method, adapter, k, p, n in runs
        ]
        return [h.result() for h in handles]
    finally:
        engine.close()


def test_mixed_batch_with_per_row_adapters_equals_generate(family):
    _, target, decoder = family
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=6, kv_slots=16))
    results = decode_batch(engine, decoder, MIXED)
    for (method, _, _, p, n), result in zip(MIXED, results, strict=True):
        assert result.token_ids == target_greedy(target, PROMPTS[p], n), method
    assert engine.stats.mean_batch >= 2  # rows shared steps


def test_a_prompt_that_begins_as_an_earlier_one_reuses_its_kv_and_stays_exact(family):
    """Prefix caching on every family: the second prompt shares the first's 20 tokens, which
    are copied rather than prefilled where the target keeps every position (no rings)."""
    _, target, decoder = family
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=2))
    first = PROMPTS[1] + [41, 42]
    runs = [("none", None, 4, first, 8), ("block", "code", 4, PROMPTS[1] + [3, 5, 7], LENGTH)]
    try:
        results = [
            engine.submit(
                decoder.prepare(
                    prompt, max_tokens=n, temperature=0, method=method, adapter=adapter,
                    num_spec_tokens=k, stop_token_ids=[],
                )
            ).result()
            for method, adapter, k, prompt, n in runs
        ]  # fmt: skip
    finally:
        engine.close()
    reused = 0 if engine.pair.target_cache.has_rings else len(PROMPTS[1])
    assert engine.stats.reused_tokens == reused
    for (method, _, _, prompt, n), result in zip(runs, results, strict=True):
        assert result.token_ids == target_greedy(target, prompt, n), method


# Largest margin (target logit of the token alone minus that of the token with speculation)
# at which a bf16 flip counts as a near-tie: a few bf16 steps (2^-7 relative) of the logits.
BF16_TIE = 0.05


def first_flip(target, prompt, alone, spec) -> tuple[int, float] | None:
    """(position, logit margin) where ``spec`` first leaves ``alone``; None if equal."""
    for i, (a, s) in enumerate(zip(alone, spec, strict=True)):
        if a != s:
            with torch.no_grad():
                logits = target(torch.tensor([prompt + alone[:i]])).logits[0, -1].float()
            return i, float(logits[a] - logits[s])
    return None


def test_bf16_speculation_equals_the_target_alone_or_flips_at_a_tie(family, capsys):
    name = family[0]
    target, draft = (model.to(torch.bfloat16) for model in family_pair(name))
    decoder = SpeculativeDecoder(target, draft)
    flips = []
    for prompt in PROMPTS:
        alone = greedy(decoder, prompt, "none")[0]
        for method in METHODS[1:]:
            spec = greedy(decoder, prompt, method)[0]
            flip = first_flip(target, prompt, alone, spec)
            if flip is not None:
                flips.append((method, *flip))
    with capsys.disabled():
        for method, position, margin in flips:
            print(f"\nbf16 flip {name} {method}: position {position}, logit margin {margin:.4f}")
    assert all(margin <= BF16_TIE for _, _, margin in flips), flips


@pytest.mark.parametrize("name", ["mistral-sliding", "gemma2", "llama4-chunked"])
def test_windowed_layers_keeping_only_their_window_stay_exact(name):
    # A prefill budget of 4 tokens: the target's forwards write at most 65 positions a row (a
    # block of k = 64), so its windowed layers keep a ring of 8 + 64 positions, which 100-token
    # outputs wrap; SpecTr's scratch slots and copied branches wrap with them.
    target, draft = family_pair(name)
    decoder = SpeculativeDecoder(target, draft)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4, max_num_batched_tokens=4))
    assert WINDOW + 64 in engine.pair.target_cache.kept  # the rings
    runs = [("block", "code", 4, 0, 100), ("spectr", "sql", 3, 1, 100), ("none", None, 4, 1, 100)]
    results = decode_batch(engine, decoder, runs)
    for (method, _, _, p, n), result in zip(runs, results, strict=True):
        assert result.token_ids == target_greedy(target, PROMPTS[p], n), method


@pytest.mark.parametrize("name", ["mistral-sliding", "gemma2"])
def test_a_row_moved_down_after_its_windowed_rings_wrapped_stays_exact(name):
    # The first row finishes after its rings (8 + 64 positions) wrapped: the rows above it
    # move down into its slot (BatchedEngine._condense), their rings copied as they lie.
    target, draft = family_pair(name)
    decoder = SpeculativeDecoder(target, draft)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4, max_num_batched_tokens=4))
    runs = [("block", "code", 4, 0, 90), ("block", None, 3, 1, 130), ("none", None, 4, 0, 150)]
    results = decode_batch(engine, decoder, runs)
    assert engine.stats.moved >= 1
    for (method, _, _, p, n), result in zip(runs, results, strict=True):
        assert result.token_ids == target_greedy(target, PROMPTS[p], n), method
