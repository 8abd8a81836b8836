"""The batched decode loop: exact in mixed batches, batch-invariant, joins, leaves, cancels."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from osd import SpeculativeDecoder
from osd.buffer.record import Record
from osd.decode.forward import ModelPair
from osd.decode.loop import BatchedEngine, EngineFull
from osd.decode.scheduler import BatchLimits

PROMPTS = [
    [3, 5, 7, 9],
    [10, 11, 12, 13, 14, 15, 16, 17],
    [42],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
]


@pytest.fixture(scope="module")
def decoder(target_model, lora_draft, tokenizer):
    return SpeculativeDecoder(target_model, lora_draft, tokenizer)


@pytest.fixture(scope="module")
def batched(decoder):
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=8, kv_slots=14))
    yield engine
    engine.close()


def target_greedy(target_model, prompt, length):
    out = target_model.generate(
        torch.tensor([prompt]), max_new_tokens=length, do_sample=False, min_new_tokens=length
    )
    return out[0, len(prompt) :].tolist()


# (method, adapter, k, max_tokens): every verifier, adapters, lengths and k differ per row.
MIXED = [
    ("block", "code", 4, 40),
    ("token", None, 2, 25),
    ("spectr", "sql", 3, 33),
    ("none", None, 4, 12),
    ("block", "sql", 6, 50),
    ("token", "code", 1, 7),
    ("spectr", None, 4, 45),
    ("block", None, 3, 20),
    ("none", "code", 4, 30),
    ("token", "sql", 5, 38),
    ("block", "code", "auto", 44),
    ("spectr", "sql", "auto", 36),
]


def test_greedy_rows_of_a_mixed_batch_equal_target_greedy(decoder, batched, target_model):
    handles = []
    for i, (method, adapter, k, max_tokens) in enumerate(MIXED):
        request = decoder.prepare(
            PROMPTS[i % len(PROMPTS)],
            max_tokens=max_tokens,
            temperature=0,
            method=method,
            adapter=adapter,
            num_spec_tokens=k,
            stop_token_ids=[],
            num_drafts=3,
        )
        handles.append(batched.submit(request))
    # 12 requests and 8 rows: some wait, then join as others leave mid-run.
    results = [h.result() for h in handles]
    for i, ((method, _, _, max_tokens), result) in enumerate(zip(MIXED, results, strict=True)):
        assert result.token_ids == target_greedy(target_model, PROMPTS[i % 4], max_tokens), method
    assert sum(r.stats.accepted for r in results) > 0
    assert batched.stats.mean_batch > 2  # rows really shared steps


@pytest.mark.parametrize("method", ["token", "block", "spectr"])
def test_seeded_request_gives_the_same_tokens_alone_and_batched(decoder, batched, method):
    kwargs = dict(
        max_tokens=30,
        temperature=0.9,
        top_p=0.95,
        seed=7,
        method=method,
        num_spec_tokens=4,  # fixed: with "auto" the k of each step depends on earlier traffic
        num_drafts=2,
    )
    alone = decoder.generate(PROMPTS[1], adapter="code", **kwargs)
    neighbours = [
        batched.submit(
            decoder.prepare(p, max_tokens=25, temperature=t, seed=s, adapter=a, method="block")
        )
        for p, t, s, a in [(PROMPTS[0], 1.0, 1, "sql"), (PROMPTS[2], 0.0, 2, None)]
    ]
    batched_result = batched.submit(decoder.prepare(PROMPTS[1], adapter="code", **kwargs)).result()
    for handle in neighbours:
        handle.result()
    assert batched_result.token_ids == alone.token_ids
    assert batched_result.log.num_accepted.tolist() == alone.log.num_accepted.tolist()
    torch.testing.assert_close(
        batched_result.log.target_top_probs.float(),
        alone.log.target_top_probs.float(),
        atol=1e-3,
        rtol=0,
    )


def test_log_data_matches_batch_of_one(decoder, batched):
    kwargs = dict(
        max_tokens=20,
        temperature=0,
        method="block",
        num_spec_tokens=4,
        adapter="sql",
        stop_token_ids=[],
    )
    alone = decoder.generate(PROMPTS[0], **kwargs).log
    others = [batched.submit(decoder.prepare(p, max_tokens=15, seed=3)) for p in PROMPTS[1:]]
    together = batched.submit(decoder.prepare(PROMPTS[0], **kwargs)).result().log
    for handle in others:
        handle.result()
    assert together.token_ids.tolist() == alone.token_ids.tolist()
    assert together.num_drafted.tolist() == alone.num_drafted.tolist()
    assert together.target_top_ids.shape == alone.target_top_ids.shape
    torch.testing.assert_close(
        together.draft_token_probs, alone.draft_token_probs, atol=1e-3, rtol=0
    )


def test_stream_chunks_arrive_per_step_and_cancel_frees_the_row(decoder, batched):
    long = batched.submit(decoder.prepare(PROMPTS[0], max_tokens=400, seed=1, stop_token_ids=[]))
    first = next(long)
    assert first.token_ids
    long.cancel()
    result = long.result()
    assert 0 < len(result.token_ids) < 400
    # Its slot is free again: a full batch still runs.
    handles = [batched.submit(decoder.prepare(p, max_tokens=5, seed=2)) for p in PROMPTS * 2]
    assert all(len(h.result().token_ids) >= 1 for h in handles)


def test_cancel_from_another_thread_while_waiting_or_decoding(decoder):
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=1))
    try:
        running = engine.submit(decoder.prepare(PROMPTS[0], max_tokens=300, stop_token_ids=[]))
        waiting = engine.submit(decoder.prepare(PROMPTS[1], max_tokens=300, stop_token_ids=[]))
        threading.Thread(target=waiting.cancel).start()
        assert waiting.result().token_ids == []
        next(running)
        running.cancel()
        assert len(running.result().token_ids) < 300
    finally:
        engine.close()


def test_full_queue_refuses_at_once_and_oversized_requests_are_value_errors(decoder):
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=1, max_waiting=2, kv_slots=2))
    try:
        handles = [
            engine.submit(decoder.prepare(PROMPTS[0], max_tokens=200, stop_token_ids=[]))
            for _ in range(2)
        ]
        with pytest.raises(EngineFull):
            for _ in range(3):  # the loop may have admitted one already
                handles.append(engine.submit(decoder.prepare(PROMPTS[0], max_tokens=200)))
        with pytest.raises(ValueError, match="KV slots"):
            engine.submit(decoder.prepare(PROMPTS[0], method="spectr", num_drafts=3))
        for handle in handles:
            handle.cancel()
    finally:
        engine.close()


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(decoder, monkeypatch):
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4))
    try:
        from osd.decode import loop

        real = loop.run_step
        calls = {"n": 0}

        def flaky(pair, rows):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected")
            return real(pair, rows)

        monkeypatch.setattr(loop, "run_step", flaky)
        # No stop token: sampled, 1 in 20 of its seeds ended at the prefill's token (its
        # end-of-sequence), before any step could fail it.
        doomed = engine.submit(decoder.prepare(PROMPTS[0], max_tokens=5, stop_token_ids=[]))
        with pytest.raises(RuntimeError, match="injected"):
            doomed.result()
        fine = engine.submit(decoder.prepare(PROMPTS[0], max_tokens=5, temperature=0))
        assert len(fine.result().token_ids) == 5 or fine.result().finish_reason == "stop"
    finally:
        engine.close()


def test_rows_near_the_context_limit_share_a_step_with_long_drafts():
    """Padding of a row that drafts little beside one that drafts much stays within the context
    (learned position embeddings index past it otherwise)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    target, draft = GPT2LMHeadModel(config).eval(), GPT2LMHeadModel(config).eval()
    decoder = SpeculativeDecoder(target, draft)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=2))
    try:
        near = list(range(2, 30))
        handles = [
            engine.submit(decoder.prepare(prompt, max_tokens=n, temperature=0, num_spec_tokens=k))
            for prompt, n, k in [(near, 4, 2), ([5, 6], 20, 8)]
        ]
        for handle, (prompt, n) in zip(handles, [(near, 4), ([5, 6], 20)], strict=True):
            assert handle.result().token_ids == target_greedy(target, prompt, n)
    finally:
        engine.close()


def test_submit_after_close_is_refused_not_left_hanging(decoder):
    engine = BatchedEngine(decoder)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(decoder.prepare(PROMPTS[0], max_tokens=3))


def test_auto_draft_length_stops_drafting_a_draft_that_never_fits(target_model, unrelated_draft):
    """With k "auto", a draft whose tokens are always rejected soon drafts nothing but its
    probes, and the output is still the target's (the draft model pinned: this tiny target
    repeats itself, and lookups would draft its loops)."""
    decoder = SpeculativeDecoder(target_model, unrelated_draft, max_spec_tokens=4)
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4))
    # Probe steps every 4 engine steps (backing off to one in 32), so the run shows them; no
    # exploration share (tests/decode/test_goodput.py), which would space these out.
    engine.controller.probe_every = 4
    engine.controller.explore_share = 1.0
    try:
        handles = [
            engine.submit(
                decoder.prepare(
                    p, max_tokens=60, temperature=0, num_spec_tokens="auto", proposer="draft"
                )
            )
            for p in PROMPTS
        ]
        results = [h.result() for h in handles]
    finally:
        engine.close()
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == target_greedy(target_model, prompt, 60)
    late = [k for r in results for k in r.stats.draft_lengths[30:]]
    assert late.count(0) > 0.8 * len(late), late  # drafting is off but for probes
    assert sum(late) > 0  # ... and the probes still run
    for result in results:  # steps without drafting still log the target's top-m rows
        record = Record.from_generation(result.log, request_id="r", domain="sql")
        assert record.num_drafted.tolist() == result.stats.draft_lengths  # k of every step
        assert record.target_top_ids.shape[0] == len(result.token_ids) == 60
        assert record.num_generated == 60


class CheapDraftCosts:
    """Step costs of a pair whose draft costs 5 % of the target (the tiny test pair's draft
    costs about as much as its target, so there speculation rightly never pays)."""

    def observe(self, batch: int, k: float, seconds: float, model: bool = True) -> None:
        pass

    def seconds(self, batch: int, max_k: int) -> list[float]:
        return [1.0 + 0.05 * k for k in range(max_k + 1)]

    def free_seconds(self, batch: int, max_k: int) -> list[float]:
        return [self.free_cost(batch, k) for k in range(max_k + 1)]

    def free_cost(self, batch: int, extra: float) -> float:
        return 1.0 + 0.01 * extra

    def lacks_base(self, batch: int) -> bool:
        return False

    def own_base(self, batch: int) -> float | None:
        return None


def test_auto_draft_length_drafts_a_draft_that_fits(decoder):
    """The draft model pinned: with lookups, the earlier tests' identical outputs let suffix
    decoding draft 8 tokens a step (tests/decode/test_proposers.py covers that)."""
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4))
    engine.controller.costs = CheapDraftCosts()  # type: ignore[assignment]
    try:
        handles = [
            engine.submit(
                decoder.prepare(
                    p,
                    max_tokens=60,
                    temperature=0,
                    num_spec_tokens="auto",
                    stop_token_ids=[],
                    proposer="draft",
                )
            )
            for p in PROMPTS
        ]
        results = [h.result() for h in handles]
    finally:
        engine.close()
    late = [k for r in results for k in r.stats.draft_lengths[20:]]
    assert sum(1 for k in late if k > 0) > 0.8 * len(late), late


def test_a_sink_gets_every_chunk_in_order_from_the_loop_thread_then_the_end(decoder, batched):
    """deliver_to: the chunks a handle queued before are handed first, the rest straight from
    the decoding thread (no thread of the consumer's waits), then None; result() answers at
    once, and the chunks are those an iterating consumer gets."""
    request = decoder.prepare(PROMPTS[1], max_tokens=200, temperature=0, method="block")
    expected = batched.submit(request).result().token_ids
    handle = batched.submit(request)
    first = next(handle)  # one chunk taken by iteration, the rest queued or still coming
    got: list[object] = []
    threads: set[str] = set()
    ended = threading.Event()

    def sink(chunk):
        threads.add(threading.current_thread().name)
        got.append(chunk)
        if chunk is None:
            ended.set()

    handle.deliver_to(sink)
    assert ended.wait(30)
    assert got[-1] is None and None not in got[:-1]
    chunks = [first, *got[:-1]]
    assert [t for chunk in chunks for t in chunk.token_ids] == expected  # type: ignore[union-attr]
    assert threads - {threading.current_thread().name}  # the decoding thread handed some
    assert handle.result().token_ids == expected
    with pytest.raises(RuntimeError, match="already delivers"):
        handle.deliver_to(sink)


def test_a_step_over_the_same_rows_reuses_their_sampling_tensors(batched, decoder):
    from osd.decode.rows import Row

    rows = [
        Row(decoder.prepare("ab", max_tokens=4, temperature=t), decoder.tokenizer)
        for t in (0.0, 0.7, 1.0)
    ]
    pair = batched.pair
    first, _ = pair.sampling(rows)
    assert pair.sampling(list(rows))[0] is first  # the same rows, a new list: reused
    for other in (rows[:2], rows[::-1], [*rows[:2], Row(rows[2].request, decoder.tokenizer)]):
        rebuilt, _ = pair.sampling(other)
        assert rebuilt is not first
        want = torch.tensor([r.request.params.temperature for r in other])
        assert torch.equal(rebuilt.temperature.cpu(), want)


class _CountOps(TorchDispatchMode):
    """Counts the tensor operations dispatched while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "options",
    [
        {"method": "none", "temperature": 1.0, "seed": 3},
        {"method": "block", "temperature": 0.0, "num_spec_tokens": 2},
        {"method": "token", "temperature": 1.0, "seed": 3, "num_spec_tokens": 2},
    ],
    ids=["target-alone-sampled", "block-greedy", "token-sampled"],
)
def test_a_steps_tensor_operations_do_not_grow_with_its_rows(decoder, monkeypatch, options):
    """Batch first: a decode step of four rows dispatches the tensor operations two rows' do,
    its log's data included (each row's share is a host slice, not a tensor op). (One row
    takes a few other branches: a plain slice where rows are gathered.)"""
    from osd.decode import loop

    real = loop.run_step
    counts: dict[int, list[int]] = {2: [], 4: []}

    def counting(pair, rows):
        with _CountOps() as mode:
            chunks = real(pair, rows)
        counts.setdefault(len(rows), []).append(mode.count)
        return chunks

    monkeypatch.setattr(loop, "run_step", counting)
    # Every prompt prefilled apart (said, though the default): a request the loop admits
    # before the next is submitted would otherwise ride in a step of its own kind
    # (fuse_prefill), one a turn, and the rows would step apart as the submissions' timing falls.
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4, fuse_prefill=False))
    try:
        for batch in (2, 4):
            handles = [
                engine.submit(
                    decoder.prepare([3, 5, 7, 9 + i], max_tokens=10, stop_token_ids=[], **options)
                )
                for i in range(batch)
            ]
            assert all(h.result().log is not None for h in handles)
    finally:
        engine.close()
    # The steps every row takes alike (the last ones draft less: fewer tokens are left).
    two, four = (max(set(c), key=c.count) for c in (counts[2], counts[4]))
    assert four == two, counts


@pytest.mark.parametrize("fuse", [True, False])
def test_a_prompt_riding_in_a_decode_step_gives_the_tokens_of_its_own_prefill(
    decoder, target_model, fuse
):
    """A request that joins rows already decoding has its prompt read in their step's forward
    (BatchLimits.fuse_prefill): its first token is drawn as after a prefill of its own, so a
    seeded request's tokens, log and logprobs are those of the request alone; greedy ones the
    target's. With fusing off it takes a forward of its own, with the same result."""
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=8, fuse_prefill=fuse))
    try:
        sampled = dict(
            max_tokens=20, temperature=0.9, seed=11, method="block", num_spec_tokens=4, logprobs=2
        )
        greedy = dict(max_tokens=16, temperature=0, method="token", stop_token_ids=[])
        # Rows decoding first, so the subjects join a running batch one at a time.
        neighbour = engine.submit(
            decoder.prepare(PROMPTS[0], max_tokens=60, temperature=1.0, seed=3, stop_token_ids=[])
        )
        next(iter(neighbour))
        riders = engine.stats.riders
        sampled_handle = engine.submit(decoder.prepare(PROMPTS[1], adapter="sql", **sampled))
        next(iter(sampled_handle))
        greedy_result = engine.submit(decoder.prepare(PROMPTS[3], **greedy)).result()
        sampled_result = sampled_handle.result()
        neighbour.result()
        assert (engine.stats.riders - riders == 2) if fuse else engine.stats.riders == 0
    finally:
        engine.close()
    alone = decoder.generate(PROMPTS[1], adapter="sql", **sampled)
    assert sampled_result.token_ids == alone.token_ids
    assert [p.logprob for p in sampled_result.logprobs] == pytest.approx(
        [p.logprob for p in alone.logprobs], abs=1e-4
    )
    torch.testing.assert_close(
        sampled_result.log.target_top_probs.float(),
        alone.log.target_top_probs.float(),
        atol=1e-3,
        rtol=0,
    )
    assert greedy_result.token_ids == target_greedy(target_model, PROMPTS[3], 16)


@pytest.mark.parametrize(
    "options",
    [
        dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
        dict(top_k=5, min_p=0.05, top_p=0.9),
        dict(logit_bias={5: 3.0, 7: -2.0}, stop=["e "]),
    ],
    ids=["penalties", "truncation", "bias-and-stop"],
)
def test_a_riding_prompt_with_sampling_options_gives_the_tokens_of_the_request_alone(
    decoder, options
):
    """The options that read the prompt (penalties count its tokens), cut the distribution or
    stop on text hold for a prompt read in a decode step as for one prefilled apart."""
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=8, fuse_prefill=True))
    request = dict(
        max_tokens=24, temperature=0.8, seed=5, method="block", num_spec_tokens=3, **options
    )
    try:
        neighbour = engine.submit(
            decoder.prepare(PROMPTS[0], max_tokens=80, temperature=1.0, seed=3, stop_token_ids=[])
        )
        next(iter(neighbour))
        riders = engine.stats.riders
        result = engine.submit(decoder.prepare(PROMPTS[3], **request)).result()
        assert engine.stats.riders == riders + 1
        neighbour.result()
    finally:
        engine.close()
    alone = decoder.generate(PROMPTS[3], **request)
    assert result.token_ids == alone.token_ids
    assert result.text == alone.text


def moved_and_alone(decoder, engine):
    """Four seeded rows (a penalty, logprobs) of which the first two finish early: the
    rows above them move down into their slots. Each row's result, and the same alone."""
    asked = [
        (
            PROMPTS[i],
            dict(
                max_tokens=max_tokens,
                temperature=0.9,
                seed=11 + i,
                method="block",
                num_spec_tokens=3,
                presence_penalty=0.7,
                logprobs=2,
                stop_token_ids=[],
            ),
        )
        for i, max_tokens in enumerate([4, 9, 30, 36])
    ]
    try:
        handles = [engine.submit(decoder.prepare(p, **kw)) for p, kw in asked]
        results = [h.result() for h in handles]
    finally:
        engine.close()
    return results, [decoder.generate(p, **kw) for p, kw in asked]


def test_rows_moved_down_into_a_finished_rows_slot_give_the_tokens_of_the_request_alone(
    decoder, monkeypatch
):
    """A batch stays in consecutive slots (it reads its keys in place): rows above a finished
    row move down into its slot, their cached positions copied (BatchedEngine._condense)."""
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4))
    results, alone = moved_and_alone(decoder, engine)
    assert engine.stats.moved >= 2
    for got, want in zip(results, alone, strict=True):
        assert got.token_ids == want.token_ids
        assert [t.logprob for t in got.logprobs] == pytest.approx(
            [t.logprob for t in want.logprobs], abs=1e-4
        )
    # Negative control: rows given the new slot without their cached positions.
    monkeypatch.setattr(
        ModelPair, "move_rows", lambda self, moves: [setattr(r, "slots", [d]) for r, d in moves]
    )
    results, alone = moved_and_alone(decoder, BatchedEngine(decoder, BatchLimits(max_num_seqs=4)))
    assert any(got.token_ids != want.token_ids for got, want in zip(results, alone, strict=True))
