"""The greedy shortcut of a step's verification (osd.decode.step._verify_greedy): for rows that
are all greedy it decides exactly what token and block verification decide over the one-hot
target distribution, for ragged rows, drafts that agree, disagree and run to the bonus token,
q one-hot (looked up, or a greedy draft) or not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from osd.decode.drafting import Drafts
from osd.decode.sampling import RowSampling, SamplingParams, rows_to_greedy_ids, rows_to_probs
from osd.decode.step import _verify, _verify_greedy

VOCAB, ROWS, WIDTH = 12, 64, 4


def _case(seed: int, one_hot_q: bool) -> tuple[torch.Tensor, Drafts]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, WIDTH + 1, VOCAB, generator=gen)
    target_ids = logits.argmax(-1)
    # Drafts that follow the target's argmax for a while, then guess: every accepted length.
    ids = torch.randint(0, VOCAB, (ROWS, 1, WIDTH), generator=gen)
    follow = torch.randint(0, WIDTH + 1, (ROWS,), generator=gen)
    keep = torch.arange(WIDTH) < follow.unsqueeze(1)
    ids[:, 0] = torch.where(keep, target_ids[:, :WIDTH], ids[:, 0])
    num_drafted = torch.randint(0, WIDTH + 1, (ROWS,), generator=gen)
    if one_hot_q:
        probs = torch.nn.functional.one_hot(ids, VOCAB).float()
    else:  # a draft's own q: some mass on its token and elsewhere
        probs = torch.softmax(torch.randn(ROWS, 1, WIDTH, VOCAB, generator=gen), -1)
        probs = 0.5 * probs + 0.5 * torch.nn.functional.one_hot(ids, VOCAB).float()
    return logits, Drafts(ids, probs, num_drafted)


@pytest.mark.parametrize("verifier", ["token", "block"])
@pytest.mark.parametrize("one_hot_q", [True, False])
def test_the_greedy_shortcut_decides_as_the_verifiers_do(verifier, one_hot_q):
    params = [SamplingParams(temperature=0.0)] * ROWS
    sampling = RowSampling.of(params, "cpu", VOCAB)
    rows = [
        SimpleNamespace(request=SimpleNamespace(verifier=verifier), verify_key=b, step=3)
        for b in range(ROWS)
    ]
    for seed in range(5):
        logits, drafts = _case(seed, one_hot_q)
        want = _verify(
            rows,  # type: ignore[arg-type]
            drafts,
            rows_to_probs(logits, sampling),
            torch.arange(ROWS),
            [1] * ROWS,
            WIDTH,
        )
        got = _verify_greedy(drafts, rows_to_greedy_ids(logits, sampling), WIDTH)
        assert torch.equal(got.num_accepted, want.num_accepted)
        assert torch.equal(got.next_token_ids, want.next_token_ids)
        assert torch.equal(got.draft_index, want.draft_index)
        assert got.num_accepted.unique().numel() > 2  # the case covers several lengths


def test_nothing_drafted_takes_the_argmax():
    logits = torch.randn(3, 1, VOCAB)
    sampling = RowSampling.of([SamplingParams(temperature=0.0)] * 3, "cpu", VOCAB)
    drafts = Drafts(
        torch.zeros(3, 1, 1, dtype=torch.int64),
        torch.zeros(3, 1, 1, VOCAB),
        torch.zeros(3, dtype=torch.int64),
    )
    got = _verify_greedy(drafts, rows_to_greedy_ids(logits, sampling), 0)
    assert got.next_token_ids.tolist() == logits[:, 0].argmax(-1).tolist()
    assert got.num_accepted.tolist() == [0, 0, 0]


def test_the_shortcut_is_for_greedy_rows_only():
    sampling = RowSampling.of([SamplingParams(temperature=0.7)], "cpu", VOCAB)
    with pytest.raises(AssertionError):
        rows_to_greedy_ids(torch.randn(1, 1, VOCAB), sampling)
