"""The log's top-m, computed beside the decoding thread on a CPU: the same records as computed
in it, one step in flight at most, and a worker that runs torch single-threaded."""

from __future__ import annotations

import threading

import pytest
import torch

from osd import SpeculativeDecoder
from osd.decode import forward, log_top_m
from osd.decode.log_top_m import LoggedPositions, LogTopM, top_m_distribution
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits

PROMPTS = [[3, 5, 7, 9], [10, 11, 12, 13, 14, 15, 16, 17], [42], [1, 2, 3, 4, 5, 6]]
# (method, k): rows that verify several positions a step, SpecTr's branches among them.
REQUESTS = [("block", 4), ("token", 2), ("spectr", 3), ("none", 1)]


def logged_batch(decoder: SpeculativeDecoder) -> list:
    """Four seeded logged requests decoded together in one batched engine; their logs."""
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4))
    try:
        handles = [
            engine.submit(
                decoder.prepare(
                    prompt,
                    max_tokens=20,
                    seed=5,
                    method=method,
                    num_spec_tokens=k,
                    num_drafts=2,
                    stop_token_ids=[],
                )
            )
            for prompt, (method, k) in zip(PROMPTS, REQUESTS, strict=True)
        ]
        return [handle.result().log for handle in handles]
    finally:
        engine.close()


def test_a_batchs_logs_are_the_same_computed_beside_the_decoding_thread_or_in_it(
    target_model, lora_draft, tokenizer, monkeypatch
):
    decoder = SpeculativeDecoder(target_model, lora_draft, tokenizer)
    assert LogTopM(32, torch.device("cpu")).beside  # what a CPU pair does by default
    beside = logged_batch(decoder)
    monkeypatch.setattr(forward, "LogTopM", lambda m, device: LogTopM(m, device, beside=False))
    within = logged_batch(decoder)
    for a, b in zip(beside, within, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.num_accepted.tolist() == b.num_accepted.tolist()
        assert torch.equal(a.target_top_ids, b.target_top_ids)
        assert torch.equal(a.target_top_probs, b.target_top_probs)
        assert torch.equal(a.draft_token_probs, b.draft_token_probs)
        assert a.target_top_ids.shape[0] == len(a.token_ids) - a.prompt_len
    assert any(int(log.num_accepted.sum()) > 0 for log in beside)  # steps kept several


@pytest.mark.parametrize("beside", [True, False])
def test_a_rows_share_is_its_first_kept_positions(beside):
    logits = torch.randn(3, 5, 50)
    starter = LogTopM(4, torch.device("cpu"), beside=beside)
    step = starter.before_sync(logits) or starter.after_sync(logits, [2, 3, 5])
    for row, count in [(0, 2), (1, 3), (2, 5), (1, 1)]:
        ids, probs = LoggedPositions(step, row, count).arrays()
        expected_ids, expected_probs = top_m_distribution(logits[row, :count], 4)
        assert ids.tolist() == expected_ids.tolist()
        assert torch.equal(torch.from_numpy(probs), expected_probs)


def test_a_pair_keeps_one_steps_top_m_in_flight(monkeypatch):
    """The second step's top-m waits for the first's: what waits is one step's logits."""
    release, started = threading.Event(), threading.Event()
    real = log_top_m._on_host_top_m

    def held(logits, m, kept=None):
        started.set()
        assert release.wait(30)
        return real(logits, m, kept)

    monkeypatch.setattr(log_top_m, "_on_host_top_m", held)
    starter = LogTopM(2, torch.device("cpu"))
    first = starter.after_sync(torch.randn(1, 1, 8), [1])
    assert started.wait(30)
    second_started = threading.Event()

    def second() -> None:
        starter.after_sync(torch.randn(1, 1, 8), [1])
        second_started.set()

    thread = threading.Thread(target=second)
    thread.start()
    try:
        assert not second_started.wait(0.2)  # held until the first step's has landed
    finally:
        release.set()  # the shared worker must not stay held for later tests
    thread.join(30)
    assert second_started.is_set()
    assert first.arrays(0, 1)[0].shape == (1, 2)


def test_the_worker_runs_torch_single_threaded():
    """A thread that ran torch in parallel keeps an OpenMP team beside the decode loop's."""
    assert log_top_m._shared_worker().submit(torch.get_num_threads).result() == 1


@pytest.mark.parametrize("beside", [True, False])
def test_a_failed_top_m_surfaces_where_the_log_is_read_or_in_the_step(monkeypatch, beside):
    """Beside, the decoding thread never waits on a failure: the log's reader gets it."""

    def broken(logits, m, kept=None):
        raise RuntimeError("top-m failed")

    monkeypatch.setattr(log_top_m, "_on_host_top_m", broken)
    starter = LogTopM(2, torch.device("cpu"), beside=beside)
    if not beside:
        with pytest.raises(RuntimeError, match="top-m failed"):
            starter.before_sync(torch.randn(1, 1, 8))
        return
    step = starter.after_sync(torch.randn(1, 1, 8), [1])
    starter.after_sync(torch.randn(1, 1, 8), [1])  # waits for the failed one without raising
    with pytest.raises(RuntimeError, match="top-m failed"):
        step.arrays(0, 1)


def test_an_ended_rows_sink_hears_of_its_end_once_its_log_landed_and_the_loop_goes_on(
    target_model, lora_draft, tokenizer, monkeypatch
):
    """Where a row ends while its last step's top-m is with the worker, its sink gets the end
    from the worker once it landed; the decoding thread meanwhile serves other requests."""
    release = threading.Event()
    real = log_top_m._on_host_top_m

    def held(logits, m, kept=None):
        if kept is not None:  # a decode step's (a prefill's first tokens are computed at once)
            assert release.wait(30)
        return real(logits, m, kept)

    monkeypatch.setattr(log_top_m, "_on_host_top_m", held)
    decoder = SpeculativeDecoder(target_model, lora_draft, tokenizer)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4))
    ended = threading.Event()
    try:
        logged = engine.submit(
            decoder.prepare(PROMPTS[0], max_tokens=2, method="none", stop_token_ids=[])
        )
        logged.deliver_to(lambda chunk: ended.set() if chunk is None else None)
        try:
            unlogged = engine.submit(
                decoder.prepare(PROMPTS[1], max_tokens=3, log=False, stop_token_ids=[])
            )
            assert len(unlogged.result().token_ids) == 3  # decoded while the log is held
            assert not ended.is_set()
        finally:
            release.set()
        assert ended.wait(30)
        log = logged.result().log
        assert log is not None and log.target_top_ids.shape[0] == 2
    finally:
        engine.close()
