"""The decode loop's warm-up: every batch size's steps run, and nothing of them is kept."""

from __future__ import annotations

import pytest

from osd import SpeculativeDecoder
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits
from osd.decode.warmup import warm_up, warmup_batch_sizes


@pytest.fixture
def engine(target_model, lora_draft, tokenizer):
    decoder = SpeculativeDecoder(
        target_model, lora_draft, tokenizer, max_spec_tokens=3, suffix_budget=10_000
    )
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=6, max_model_len=96), num_threads=1)
    yield engine
    engine.close()


def test_batch_sizes_are_the_powers_of_two_up_to_the_most_rows():
    assert warmup_batch_sizes(16) == (1, 2, 4, 8, 16)
    assert warmup_batch_sizes(12) == (1, 2, 4, 8, 12)
    assert warmup_batch_sizes(1) == (1,)


def test_warm_up_runs_each_batch_size_drafted_and_not_and_keeps_nothing(engine, monkeypatch):
    controller, proposers = engine.pair.controller, engine.pair.proposers
    batches: list[tuple[int, bool]] = []  # (rows, a row has drafted: model or lookup)
    import osd.decode.loop as loop

    real_step = loop.run_step

    steps_uneven: list[tuple[int, bool]] = []  # (rows, lookups verified beside none)

    def counting_step(pair, rows):
        chunks = real_step(pair, rows)
        drafted = any(r.stats.drafted for r in rows)
        batches.append((len(rows), drafted))
        last = [r.stats.draft_lengths[-1] if r.stats.draft_lengths else 0 for r in rows]
        looked_up = any(
            n and r.stats.step_proposers[-1] == "suffix" for n, r in zip(last, rows, strict=True)
        )
        steps_uneven.append((len(rows), looked_up and 0 in last))
        return chunks

    monkeypatch.setattr(loop, "run_step", counting_step)
    draft_forwards: list[tuple[int, frozenset]] = []  # (rows, their adapters)
    draft = engine.decoder.draft
    real_run = draft.run

    def recording_run(plan, cache, *, num_logits, adapters=None):
        rows = plan.input_ids.shape[0]
        draft_forwards.append((rows, frozenset(adapters or [None])))
        return real_run(plan, cache, num_logits=num_logits, adapters=adapters)

    monkeypatch.setattr(draft, "run", recording_run)
    report = warm_up(engine)
    assert report.batch_sizes == (1, 2, 4, 6)
    assert report.requests == 4 * (1 + 2 + 4 + 6) and report.failed == 0
    # The draft model ran over several rows all on one adapter (its merged forward, whose
    # graphs model.compile compiles here rather than on served traffic), at 6 rows too.
    adapter = engine.decoder.adapters[0]
    assert any(rows == 6 and adapters == {adapter} for rows, adapters in draft_forwards)
    assert report.steps == len(batches) > 0
    assert {rows for rows, _ in batches} >= {1, 2, 4, 6}
    assert any(drafted for _, drafted in batches)  # the drafted round drafted
    assert "warm-up: 52 requests" in report.describe()
    # The uneven round: looked-up drafts verified beside rows without any (a packed verify
    # forward; how many rows a step held depends on when the loop took each request).
    assert any(uneven for _, uneven in steps_uneven)
    # The replica's own controller, suffix store and counters never saw it.
    assert engine.pair.controller is controller and engine.pair.proposers is proposers
    assert controller.steps == 0 and not controller.curves
    assert all(lookup.num_tokens() == 0 for lookup in proposers.lookups.values())
    assert engine.stats.steps == 0
    # The control: the same traffic served after it is counted in all three.
    decoder = engine.decoder
    engine.submit(decoder.prepare([5, 6, 7, 8] * 4, max_tokens=8, stop_token_ids=())).result()
    assert controller.steps > 0 and controller.curves and engine.stats.steps > 0
    assert sum(lookup.num_tokens() for lookup in proposers.lookups.values()) > 0


def test_a_context_too_short_to_warm_up_in_is_skipped(target_model, lora_draft, tokenizer):
    decoder = SpeculativeDecoder(target_model, lora_draft, tokenizer)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=2, max_model_len=3), num_threads=1)
    try:
        report = warm_up(engine)
    finally:
        engine.close()
    assert report.requests == 0 and report.describe() == "engine warm-up skipped"
