"""Several choices of one prompt (OpenAI's n): each equals a request alone with its derived seed,
the prompt is prefilled once, and groups join, leave and cancel as they should."""

from __future__ import annotations

import threading

import pytest

from osd import SpeculativeDecoder
from osd.decode.choices import choice_requests, choice_seed
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits

PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.fixture(scope="module")
def decoder(target_model, lora_draft, tokenizer):
    return SpeculativeDecoder(target_model, lora_draft, tokenizer)


@pytest.fixture(scope="module")
def batched(decoder):
    # A prompt longer than a step's prefill budget: the leader prefills in chunks. The tests
    # count the prompt's tokens through the target: none is copied from an earlier test's
    # slot (prefix caching: tests/decode/test_prefix_reuse.py).
    engine = BatchedEngine(
        decoder,
        BatchLimits(max_num_seqs=8, kv_slots=12, max_num_batched_tokens=5, prefix_caching=False),
    )
    yield engine
    engine.close()


def finished(handles: list, timeout_s: float = 120.0) -> list:
    """The handles' results; fails, instead of waiting forever, when some never finish (rows
    left waiting for slots that were not given back)."""
    results: list = []
    waiter = threading.Thread(target=lambda: results.extend(h.result() for h in handles))
    waiter.daemon = True
    waiter.start()
    waiter.join(timeout_s)
    assert len(results) == len(handles), f"{len(handles) - len(results)} rows never finished"
    return results


class TokenCounter:
    """Counts the real (non-padding) tokens each model forwards, wrapping its ``run``."""

    def __init__(self, monkeypatch, decoder) -> None:
        self.counts = {"target": 0, "draft": 0}
        for name in self.counts:
            model = getattr(decoder, name)
            monkeypatch.setattr(model, "run", self._wrap(name, model.run))

    def _wrap(self, name, run):
        def counted(plan, cache, **kwargs):
            self.counts[name] += int((plan.write_slot != cache.trash_slot).sum())
            return run(plan, cache, **kwargs)

        return counted


def options(method: str, **extra):
    defaults = dict(
        max_tokens=24,
        temperature=1.0,
        top_p=0.95,
        method=method,
        num_spec_tokens=3,  # fixed: with "auto" each step's k depends on earlier traffic
        num_drafts=2,
        adapter="code",
        stop_token_ids=[],
    )
    return {**defaults, **extra}


def test_choice_seeds_keep_choice_zero_and_differ():
    seeds = [choice_seed(123, i) for i in range(16)]
    assert seeds[0] == 123
    assert len(set(seeds)) == 16
    assert all(-(2**63) <= s < 2**63 for s in seeds)  # the record stores an int64
    assert choice_seed(124, 1) != seeds[1]


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("token", {}),
        ("block", {"frequency_penalty": 0.5, "presence_penalty": 0.3}),
        ("spectr", {}),
        ("none", {"logprobs": 2}),
    ],
)
def test_choices_equal_requests_alone_with_derived_seeds(decoder, batched, method, extra):
    kwargs = options(method, **extra)
    group = choice_requests(decoder.prepare(PROMPT, seed=99, **kwargs), 3)
    neighbour = batched.submit(decoder.prepare(PROMPT[:4], seed=5, max_tokens=30))
    results = [h.result() for h in batched.submit_group(group)]
    neighbour.result()
    for i, result in enumerate(results):
        alone = decoder.generate(PROMPT, seed=choice_seed(99, i), **kwargs)
        assert result.token_ids == alone.token_ids, i
        assert result.log.num_accepted.tolist() == alone.log.num_accepted.tolist()
        assert result.log.request.seed == choice_seed(99, i)
        if extra.get("logprobs") is not None:
            assert [e.logprob for e in result.logprobs] == pytest.approx(
                [e.logprob for e in alone.logprobs], abs=1e-5
            )
    assert len({tuple(r.token_ids) for r in results}) == 3  # independent samples differ
    # Choice 0 is the plain request with the seed itself.
    assert results[0].token_ids == decoder.generate(PROMPT, seed=99, **kwargs).token_ids


def test_group_prefills_its_prompt_once(decoder, batched, monkeypatch):
    counter = TokenCounter(monkeypatch, decoder)
    # One token each: the choices' first tokens come with the prefill, no step runs.
    group = choice_requests(decoder.prepare(PROMPT, seed=1, **options("block", max_tokens=1)), 4)
    results = [h.result() for h in batched.submit_group(group)]
    assert [len(r.token_ids) for r in results] == [1, 1, 1, 1]
    # The draft reads a prompt only when it first drafts: one token each never needs it.
    assert counter.counts == {"target": len(PROMPT), "draft": 0}


def test_python_api_choices_share_the_prefill_and_equal_generate(decoder, monkeypatch):
    kwargs = options("block", seed=7)
    results = decoder.generate_choices(PROMPT, 3, **kwargs)
    for i, result in enumerate(results):
        alone = decoder.generate(PROMPT, **{**kwargs, "seed": choice_seed(7, i)})
        assert result.token_ids == alone.token_ids
    counter = TokenCounter(monkeypatch, decoder)
    firsts = decoder.generate_choices(PROMPT, 3, **{**kwargs, "max_tokens": 1})
    assert [r.token_ids for r in firsts] == [r.token_ids[:1] for r in results]
    assert counter.counts == {"target": len(PROMPT), "draft": 0}


def test_cancelled_choice_leaves_its_siblings_decoding(decoder, batched):
    group = choice_requests(decoder.prepare(PROMPT, seed=3, **options("token")), 3)
    handles = batched.submit_group(group)
    handles[1].cancel()
    results = [handles[0].result(), handles[2].result()]
    assert all(len(r.token_ids) == 24 for r in results)
    handles[1].result()  # ends (early) instead of hanging
    assert results[0].token_ids == decoder.generate(PROMPT, seed=3, **options("token")).token_ids


def test_group_cancelled_before_its_prefill_frees_its_slots(decoder):
    engine = BatchedEngine(decoder, BatchLimits(max_num_seqs=4, kv_slots=4))
    try:
        blocker = engine.submit(decoder.prepare(PROMPT, seed=1, max_tokens=40, method="none"))
        group = choice_requests(decoder.prepare(PROMPT, seed=2, **options("block")), 4)
        handles = engine.submit_group(group)  # waits: 4 rows do not fit beside the blocker
        for handle in handles:
            handle.cancel()
        for handle in handles:
            handle.result()
        blocker.result()
        # A group needing all 4 slots runs only if every slot came back: the cancelled group's
        # and the blocker's, then (the second time) its own.
        for _ in range(2):
            after = finished(engine.submit_group(group))
            assert all(len(r.token_ids) == 24 for r in after)
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("n", "kwargs", "message"),
    [
        (7, {"method": "spectr", "num_drafts": 2}, "KV slots"),
        (9, {"method": "token", "num_drafts": 1}, "rows"),
    ],
)
def test_groups_that_can_never_fit_are_refused(decoder, batched, n, kwargs, message):
    request = decoder.prepare(PROMPT, seed=1, temperature=1.0, **kwargs)
    with pytest.raises(ValueError, match=message):
        batched.submit_group(choice_requests(request, n))


def test_group_members_must_share_everything_but_the_seed(decoder, batched):
    first = decoder.prepare(PROMPT, seed=1)
    other = decoder.prepare(PROMPT[:-1], seed=2)
    with pytest.raises(ValueError, match="only in their seed"):
        batched.submit_group([first, other])
