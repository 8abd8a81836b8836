"""Prompts that begin as an earlier one did: their shared positions' KV copied, not prefilled
(osd.decode.prefix_reuse, BatchedEngine._reuse_prefixes), with the request alone's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from osd import SpeculativeDecoder
from osd.decode.choices import choice_requests
from osd.decode.forward import ModelPair
from osd.decode.loop import BatchedEngine
from osd.decode.prefix_reuse import SlotContents, common_prefix
from osd.decode.scheduler import BatchLimits
from tests.families import family_pair

BASE = [(7 * i + 3) % 60 + 2 for i in range(20)]  # a shared beginning, 20 tokens
SUBJECT = dict(
    max_tokens=24, temperature=0.9, seed=11, method="block", num_spec_tokens=3, logprobs=2
)


@pytest.fixture(scope="module")
def decoder(target_model, lora_draft, tokenizer):
    return SpeculativeDecoder(target_model, lora_draft, tokenizer)


def test_common_prefix_counts_the_leading_tokens_two_sequences_share():
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, np.array([1, 2])) == 2
    assert common_prefix(a, np.array([5])) == 0
    assert common_prefix(a, np.array([], dtype=np.int64)) == 0


def test_the_best_source_is_the_longest_shared_beginning_short_of_the_last_token():
    contents = SlotContents(min_tokens=3)
    prompt = [1, 2, 3, 4, 5, 6]
    contents.keep(4, [1, 2, 3, 9])  # 3 shared
    contents.keep(5, [1, 2])  # too short to keep
    assert len(contents) == 1
    live = [(6, [1, 2, 3, 4, 8]), (7, [2, 2, 3, 4, 5, 6])]
    assert contents.best(prompt, (0, None), live) == (6, 4)
    # The whole prompt held somewhere: all but its last token (its logits come from a forward).
    assert contents.best(prompt, (0, np.array(prompt + [7])), live) == (0, 5)
    # Under min_tokens, nothing.
    assert contents.best([1, 2, 8, 8], (0, None), live) == (0, 0)
    # A tie goes to the row's own slot: nothing to copy.
    assert contents.best([1, 2, 3, 8, 8], (0, np.array([1, 2, 3, 0])), []) == (0, 3)
    assert contents.take([4, 9]).keys() == {4}
    assert len(contents) == 0


def test_what_a_handed_out_slot_held_moves_to_a_free_slot_the_oldest_kept_making_room():
    contents = SlotContents(min_tokens=2)
    contents.keep(5, [1, 1])
    contents.keep(6, [2, 2])
    taken = contents.take([0])  # held nothing
    assert contents.preserve(taken, [3, 5, 6]) == []
    contents.keep(0, [7, 7, 7])
    taken = contents.take([0])
    # Slot 3 is empty: the highest empty free slot takes it.
    assert contents.preserve(taken, [3, 4, 5, 6]) == [(0, 4, 3)]
    contents.keep(1, [8, 8])
    taken = contents.take([1])
    # Slot 3 is still empty; then none is: the oldest kept of the free slots (5) goes.
    assert contents.preserve(taken, [3, 4, 5, 6]) == [(1, 3, 2)]
    contents.keep(2, [9, 9])
    assert contents.preserve(contents.take([2]), [3, 4, 5, 6]) == [(2, 5, 2)]
    assert contents.best([9, 9, 9], (0, None), []) == (5, 2)
    assert contents.best([1, 1, 1], (0, None), []) == (0, 0)  # forgotten


def test_more_slots_handed_out_than_free_ones_write_each_free_slot_once():
    """The copies of one call run as one: two into one slot would leave either's KV there."""
    contents = SlotContents(min_tokens=2)
    for slot, token in ((0, 1), (1, 2), (2, 3)):
        contents.keep(slot, [token, token])
    assert contents.preserve(contents.take([0, 1, 2]), [3]) == [(0, 3, 2)]
    assert contents.best([1, 1, 1], (9, None), []) == (3, 2)
    # What another free slot holds already (as its beginning) is not copied again.
    contents.keep(4, [4, 4, 4])
    contents.keep(7, [4, 4])
    assert contents.preserve(contents.take([7]), [3, 4, 5]) == []


def test_one_client_at_a_time_reuses_a_beginning_from_before_the_last_request(decoder):
    """Joiners take the lowest free slot: what it held moves to another free slot first, so
    the free slots keep several requests' beginnings, not only the last one's."""
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4))
    try:
        engine.submit(decoder.prepare(BASE + [5], max_tokens=4, temperature=0)).result()
        other = [(5 * i + 1) % 60 + 2 for i in range(12)]
        engine.submit(decoder.prepare(other, max_tokens=4, temperature=0)).result()
        result = engine.submit(decoder.prepare(BASE + [30, 31, 32], **SUBJECT)).result()
    finally:
        engine.close()
    assert engine.stats.reused_tokens == len(BASE)
    assert_as_alone(decoder, result, BASE + [30, 31, 32])


def finished_then_subject(decoder, limits: BatchLimits, tail: list[int]):
    """A request whose prompt is BASE, finished; then the subject, BASE + ``tail``, seeded."""
    engine = BatchedEngine(decoder, limits)
    try:
        engine.submit(
            decoder.prepare(BASE + [5], max_tokens=6, temperature=0, stop_token_ids=[])
        ).result()
        result = engine.submit(decoder.prepare(BASE + tail, **SUBJECT)).result()
    finally:
        engine.close()
    return result, engine.stats


def beside_then_subject(decoder, limits: BatchLimits, tail: list[int]):
    """A request decoding (prompt BASE + [9, 9]) while the subject, BASE + ``tail``, joins."""
    engine = BatchedEngine(decoder, limits)
    try:
        neighbour = engine.submit(
            decoder.prepare(BASE + [9, 9], max_tokens=80, temperature=1.0, seed=3)
        )
        next(iter(neighbour))
        result = engine.submit(decoder.prepare(BASE + tail, **SUBJECT)).result()
        neighbour.result()
    finally:
        engine.close()
    return result, engine.stats


def assert_as_alone(decoder, result, prompt):
    alone = decoder.generate(prompt, **SUBJECT)
    assert result.token_ids == alone.token_ids
    assert [t.logprob for t in result.logprobs] == pytest.approx(
        [t.logprob for t in alone.logprobs], abs=1e-4
    )


@pytest.mark.parametrize("source", [finished_then_subject, beside_then_subject])
def test_a_prompt_that_begins_as_another_did_reuses_its_kv_and_decodes_as_alone(decoder, source):
    tail = [30, 31, 32]
    result, stats = source(decoder, BatchLimits(max_num_seqs=4), tail)
    assert stats.reused_tokens == len(BASE)
    assert stats.prompt_tokens >= 2 * len(BASE)
    assert_as_alone(decoder, result, BASE + tail)


def test_negative_control_a_prompt_started_without_the_copied_positions_decodes_otherwise(
    decoder, monkeypatch
):
    """The neighbour's slot is the source: without the copy the subject's first positions hold
    whatever its own slot had."""
    monkeypatch.setattr(ModelPair, "copy_prefixes", lambda self, copies: None)
    result, stats = beside_then_subject(decoder, BatchLimits(max_num_seqs=4), [30, 31, 32])
    assert stats.reused_tokens == len(BASE)
    alone = decoder.generate(BASE + [30, 31, 32], **SUBJECT)
    assert result.token_ids != alone.token_ids


def test_no_reuse_when_switched_off_or_when_the_prompts_logprobs_are_asked_for(decoder):
    _, stats = beside_then_subject(decoder, BatchLimits(max_num_seqs=4, prefix_caching=False), [1])
    assert stats.reused_tokens == 0 and stats.prompt_tokens > 0
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4))
    try:
        engine.submit(decoder.prepare(BASE + [5], max_tokens=4, temperature=0)).result()
        asked = decoder.prepare(BASE + [6], max_tokens=4, temperature=0, prompt_logprobs=1)
        result = engine.submit(asked).result()
    finally:
        engine.close()
    assert engine.stats.reused_tokens == 0
    assert len(result.prompt_logprobs) == len(BASE) + 1


def test_a_row_moved_down_leaves_its_beginning_for_the_next_prompt(decoder):
    """Two rows; the first finishes, the second moves down into its slot (condense): its old
    slot keeps what it held, and a prompt like it later copies from whichever slot holds it."""
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=2))
    try:
        # A token a step each: the second joins while the first decodes, and outlives it.
        alike = dict(temperature=0, method="none", stop_token_ids=[])
        first = engine.submit(decoder.prepare([1, 2, 3], max_tokens=40, **alike))
        next(iter(first))  # in slot 0
        second = engine.submit(decoder.prepare(BASE + [4], max_tokens=80, **alike))
        first.result(), second.result()
        moved = engine.stats.moved
        result = engine.submit(decoder.prepare(BASE + [30, 31, 32], **SUBJECT)).result()
    finally:
        engine.close()
    assert moved >= 1
    assert engine.stats.reused_tokens == len(BASE)
    assert_as_alone(decoder, result, BASE + [30, 31, 32])


def test_a_windowed_target_reuses_nothing(tokenizer):
    """Its slots keep rings of recent positions (its window and a forward's tokens: prompts
    prefilled in chunks of 8), overwritten as their rows went on."""
    target, draft = family_pair("mistral-sliding")
    decoder = SpeculativeDecoder(target, draft, tokenizer)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=2, max_num_batched_tokens=8))
    try:
        assert engine.pair.target_cache.has_rings
        engine.submit(decoder.prepare(BASE + [5], max_tokens=4, temperature=0)).result()
        engine.submit(decoder.prepare(BASE + [6], max_tokens=4, temperature=0)).result()
    finally:
        engine.close()
    assert engine.stats.reused_tokens == 0


def test_the_choices_of_a_prompt_that_reuses_a_beginning_decode_as_without_it(decoder):
    """OpenAI's n: the leader copies the beginning, prefills the rest, and its followers get
    the whole prompt's KV from it (osd.decode.choices)."""

    def group_after_base(caching: bool) -> list[list[int]]:
        engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4, prefix_caching=caching))
        try:
            engine.submit(decoder.prepare(BASE + [5], max_tokens=4, temperature=0)).result()
            group = choice_requests(decoder.prepare(BASE + [30, 31], **SUBJECT), 3)
            results = [h.result().token_ids for h in engine.submit_group(group)]
        finally:
            engine.close()
        assert engine.stats.reused_tokens == (len(BASE) if caching else 0)
        return results

    assert group_after_base(True) == group_after_base(False)
