"""Exact-enumeration tests of the verifiers (docs/algorithms.md, "Testing exactness").

Every draft and every verifier outcome is enumerated over a tiny vocabulary with
context-dependent toy distributions; the distribution of the first k + 1 emitted tokens must
equal the target's. Each uniform is compared with one threshold, so one representative value per
side of it (weighted by the side's length) covers every outcome with the real verifier code.
"""

from __future__ import annotations

import itertools
import zlib
from collections import defaultdict
from collections.abc import Callable
from functools import cache

import numpy as np
import pytest
import torch

from osd.decode.sampling import sample_from_probs
from osd.decode.verification import (
    block_acceptance_probs,
    block_verify,
    kseq_step,
    spectr_verify,
    token_acceptance_probs,
    token_verify,
)

Sequence = tuple[int, ...]


@cache
def toy_dist(context: Sequence, vocab_size: int, salt: str) -> torch.Tensor:
    """A context-dependent distribution, sometimes with a zero entry."""
    seed = zlib.crc32(f"{salt}:{vocab_size}:{context}".encode())
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(vocab_size, 0.7))
    if rng.random() < 0.3:
        probs[rng.integers(vocab_size)] = 0.0
        probs /= probs.sum()
    return torch.tensor(probs, dtype=torch.float64)


def target_seq_prob(prefix: Sequence, seq: Sequence, vocab_size: int) -> float:
    prob = 1.0
    for i, token in enumerate(seq):
        prob *= float(toy_dist(prefix + seq[:i], vocab_size, "p")[token])
    return prob


OneStep = Callable[[Sequence], dict[Sequence, float]]


def emitted_distribution(one_step: OneStep, prefix: Sequence, length: int) -> dict:
    """Distribution of the first ``length`` emitted tokens, running steps until enough."""
    out: dict[Sequence, float] = defaultdict(float)
    for emitted, weight in one_step(prefix).items():
        if len(emitted) >= length:
            out[emitted[:length]] += weight
            continue
        rest = emitted_distribution(one_step, prefix + emitted, length - len(emitted))
        for tail, tail_weight in rest.items():
            out[emitted + tail] += weight * tail_weight
    return out


def uniform_cells(thresholds: torch.Tensor) -> list[tuple[torch.Tensor, float]]:
    """All (representative uniforms, weight) pairs for a 1-D vector of thresholds."""
    cells = []
    for accept in itertools.product([True, False], repeat=thresholds.numel()):
        flags = torch.tensor(accept)
        weight = float(torch.where(flags, thresholds, 1 - thresholds).prod())
        if weight > 0:
            cells.append((torch.where(flags, thresholds / 2, (1 + thresholds) / 2), weight))
    return cells


def stopped_drafts(prefix: Sequence, k: int, vocab_size: int, stop_below: float):
    """Every draft with its probability, drafting stopping after a token with q < stop_below."""

    def extend(draft: Sequence, prob: float):
        if len(draft) == k or (
            draft and float(toy_dist(prefix + draft[:-1], vocab_size, "q")[draft[-1]]) < stop_below
        ):
            yield draft, prob
            return
        for token, q in enumerate(toy_dist(prefix + draft, vocab_size, "q").tolist()):
            if q > 0:
                yield from extend(draft + (token,), prob * q)

    return extend((), 1.0)


def single_draft_step(method: str, k: int, vocab_size: int, stop_below: float = 0.0) -> OneStep:
    verify = {"token": token_verify, "block": block_verify}[method]

    def one_step(prefix: Sequence) -> dict[Sequence, float]:
        out: dict[Sequence, float] = defaultdict(float)
        for draft, draft_prob in stopped_drafts(prefix, k, vocab_size, stop_below):
            n = len(draft)
            q = torch.stack([toy_dist(prefix + draft[:i], vocab_size, "q") for i in range(n)])
            p = torch.stack([toy_dist(prefix + draft[:i], vocab_size, "p") for i in range(n + 1)])
            ids, q, p = torch.tensor([draft]), q[None], p[None]
            if method == "token":
                thresholds = token_acceptance_probs(ids, q, p)[0]
            else:
                thresholds = block_acceptance_probs(ids, q, p)[1][0]
            for uniforms, weight in uniform_cells(thresholds):
                result = verify(ids, q, p, uniforms[None], torch.zeros(1))
                kept = draft[: int(result.num_accepted)]
                for token, prob in enumerate(result.next_token_probs[0].tolist()):
                    out[kept + (token,)] += draft_prob * weight * prob
        return out

    return one_step


def kseq_tree_step(k: int, num_drafts: int, vocab_size: int) -> OneStep:
    """One SpecTr step; drafts are expanded lazily: alive drafts are i.i.d. given the prefix."""

    @cache
    def expand(prefix: Sequence, kept: Sequence, num_alive: int) -> dict[Sequence, float]:
        context = prefix + kept
        out: dict[Sequence, float] = defaultdict(float)
        if len(kept) == k:
            for token, prob in enumerate(toy_dist(context, vocab_size, "p").tolist()):
                out[kept + (token,)] += prob
            return out
        p, q = toy_dist(context, vocab_size, "p"), toy_dist(context, vocab_size, "q")
        all_candidates = list(itertools.product(range(vocab_size), repeat=num_alive))
        ids = torch.tensor(all_candidates)  # (N, K)
        n = len(all_candidates)
        p, q = p.expand(n, -1), q.expand(n, -1)
        alive = torch.ones(n, num_alive, dtype=torch.bool)
        _, accept_probs, _ = kseq_step(p, q, ids, alive, torch.zeros(n, num_alive))
        draw_probs = q.gather(1, ids).prod(dim=1)  # (N,)
        for first in [*range(num_alive), -1]:  # first accepted candidate, or none
            accept = torch.tensor([j == first for j in range(num_alive)])
            seen = torch.tensor([first < 0 or j <= first for j in range(num_alive)])
            a = accept_probs
            weights = draw_probs * torch.where(accept, a, torch.where(seen, 1 - a, 1.0)).prod(1)
            uniforms = torch.where(accept, a / 2, (1 + a) / 2)
            index, _, residual = kseq_step(p, q, ids, alive, uniforms)
            for row in torch.nonzero(weights > 0).flatten().tolist():
                weight = float(weights[row])
                assert int(index[row]) == first
                if first < 0:
                    for token, prob in enumerate(residual[row].tolist()):
                        out[kept + (token,)] += weight * prob
                    continue
                token = all_candidates[row][first]
                deeper = expand(prefix, kept + (token,), all_candidates[row].count(token))
                for emitted, prob in deeper.items():
                    out[emitted] += weight * prob
        return out

    return lambda prefix: expand(prefix, (), num_drafts)


def assert_matches_target(one_step: OneStep, prefix: Sequence, k: int, vocab_size: int):
    emitted = emitted_distribution(one_step, prefix, k + 1)
    for seq in itertools.product(range(vocab_size), repeat=k + 1):
        expected = target_seq_prob(prefix, seq, vocab_size)
        assert abs(emitted.get(seq, 0.0) - expected) < 1e-9, (seq, emitted.get(seq), expected)
    assert abs(sum(emitted.values()) - 1.0) < 1e-9


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize(("k", "vocab_size"), [(1, 3), (2, 3), (3, 3), (1, 5), (2, 4)])
def test_single_draft_verifier_emits_target_distribution(method, k, vocab_size):
    assert_matches_target(single_draft_step(method, k, vocab_size), (1,), k, vocab_size)


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("stop_below", [0.3, 0.5])
def test_adaptive_draft_length_keeps_output_exact(method, stop_below):
    """Stopping the draft on its own low confidence depends only on the draft: still exact."""
    step = single_draft_step(method, 3, 3, stop_below=stop_below)
    assert_matches_target(step, (1,), 3, 3)


@pytest.mark.parametrize(
    ("k", "num_drafts", "vocab_size"),
    [(1, 1, 3), (1, 2, 4), (1, 3, 3), (1, 4, 3), (2, 2, 3), (2, 3, 3), (2, 4, 3), (3, 2, 3)],
)
def test_kseq_emits_target_distribution(k, num_drafts, vocab_size):
    assert_matches_target(kseq_tree_step(k, num_drafts, vocab_size), (2,), k, vocab_size)


def test_negative_control_wrong_draft_distribution_is_detected():
    """Verifying with a q other than the one sampled from must break exactness."""

    def wrong_q_step(prefix: Sequence) -> dict[Sequence, float]:
        out: dict[Sequence, float] = defaultdict(float)
        for token, prob_q in enumerate(toy_dist(prefix, 3, "q").tolist()):
            wrong_q = toy_dist(prefix, 3, "other")[None, None]
            p = torch.stack([toy_dist(prefix, 3, "p"), toy_dist(prefix + (token,), 3, "p")])[None]
            ids = torch.tensor([[token]])
            for uniforms, weight in uniform_cells(token_acceptance_probs(ids, wrong_q, p)[0]):
                result = token_verify(ids, wrong_q, p, uniforms[None], torch.zeros(1))
                kept = (token,) * int(result.num_accepted)
                for y, prob in enumerate(result.next_token_probs[0].tolist()):
                    out[kept + (y,)] += prob_q * weight * prob
        return out

    with pytest.raises(AssertionError):
        assert_matches_target(wrong_q_step, (0,), 1, 3)


def paper_toy_expected_accepted(verify: Callable, thresholds_of: Callable) -> float:
    """Vocab {0, 1}, p = (1/3, 2/3), q = (2/3, 1/3) at every position, k = 2 (Sun et al.)."""
    p = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64).expand(1, 3, 2)
    q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64).expand(1, 2, 2)
    total = 0.0
    for draft in itertools.product(range(2), repeat=2):
        ids = torch.tensor([draft])
        draft_prob = float(q[0, torch.arange(2), ids[0]].prod())
        for uniforms, weight in uniform_cells(thresholds_of(ids, q, p)):
            accepted = int(verify(ids, q, p, uniforms[None], torch.zeros(1)).num_accepted)
            total += draft_prob * weight * accepted
    return total


def test_block_verification_matches_paper_toy_values():
    token = paper_toy_expected_accepted(token_verify, lambda *a: token_acceptance_probs(*a)[0])
    block = paper_toy_expected_accepted(block_verify, lambda *a: block_acceptance_probs(*a)[1][0])
    assert token == pytest.approx(10 / 9, abs=1e-12)
    assert block == pytest.approx(11 / 9, abs=1e-12)


def random_batch(batch: int, num_drafts: int, k: int, vocab_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.distributions.Dirichlet(torch.full((vocab_size,), 0.5)).sample((batch, num_drafts, k))
    p = torch.distributions.Dirichlet(torch.full((vocab_size,), 0.5)).sample(
        (batch, num_drafts, k + 1)
    )
    ids = torch.multinomial(q.reshape(-1, vocab_size), 1, generator=gen).reshape(
        batch, num_drafts, k
    )
    return ids, q, p, gen


def test_block_accepts_at_least_as_many_as_token_on_same_inputs():
    torch.manual_seed(0)
    ids, q, p, gen = random_batch(20000, 1, 4, 6, seed=0)
    ids, q, p = ids[:, 0], q[:, 0], p[:, 0]
    uniforms = torch.rand(20000, 4, generator=gen)
    sample_u = torch.rand(20000, generator=gen)
    token = token_verify(ids, q, p, uniforms, sample_u).num_accepted.double().mean()
    block = block_verify(ids, q, p, uniforms, sample_u).num_accepted.double().mean()
    # In expectation block >= token (Sun et al. 2024); exact expectations make this sharp.
    token_exp = token_acceptance_probs(ids, q, p).cumprod(dim=1).sum(dim=1).mean()
    assert block >= token_exp - 0.02
    assert block >= token - 0.02


def test_block_with_one_token_and_spectr_with_one_draft_are_token_verification():
    """k = 1: block's h_1 = w_1 = min(1, p/q) and its residual weight w_0 = 1; K = 1: rho* = 1.

    Both then decide as token verification, the case the shared tail takes with weight one.
    """
    ids, q, p, gen = random_batch(4000, 1, 1, 5, seed=3)
    q, p = q.double(), p.double()
    uniforms = torch.rand(4000, 1, 1, generator=gen, dtype=torch.float64)
    sample_u = torch.rand(4000, generator=gen, dtype=torch.float64)
    token = token_verify(ids[:, 0], q[:, 0], p[:, 0], uniforms[:, 0], sample_u)
    block = block_verify(ids[:, 0], q[:, 0], p[:, 0], uniforms[:, 0], sample_u)
    tree = spectr_verify(ids, q, p, uniforms, sample_u)
    assert token.num_accepted.sum() not in (0, 4000)  # both branches of the tail are taken
    for other in (block, tree):
        assert torch.equal(other.num_accepted, token.num_accepted)
        torch.testing.assert_close(other.next_token_probs, token.next_token_probs)
        assert torch.equal(other.next_token_ids, token.next_token_ids)


def test_spectr_matches_stepwise_kseq_reference():
    torch.manual_seed(1)
    ids, q, p, gen = random_batch(64, 3, 3, 4, seed=1)
    uniforms = torch.rand(64, 3, 3, generator=gen)
    result = spectr_verify(ids, q, p, uniforms, torch.rand(64, generator=gen))
    for b in range(64):
        alive = torch.ones(1, 3, dtype=torch.bool)
        kept = 0
        for depth in range(3):
            rep = int(alive.int().argmax())
            index, _, residual = kseq_step(
                p[b, rep, depth][None],
                q[b, rep, depth][None],
                ids[b, :, depth][None],
                alive,
                uniforms[b, :, depth][None],
            )
            if int(index) < 0:
                torch.testing.assert_close(result.next_token_probs[b], residual[0])
                break
            kept += 1
            alive = alive & (ids[b, :, depth] == ids[b, int(index), depth])
        assert int(result.num_accepted[b]) == kept
        draft = int(result.draft_index[b])
        assert bool(alive[0, draft])


def test_greedy_one_hot_accepts_exactly_the_matching_prefix():
    vocab_size, k = 5, 3
    target_argmax = torch.tensor([1, 2, 3, 4])
    draft_ids = torch.tensor([[1, 2, 0]])
    p = torch.nn.functional.one_hot(target_argmax, vocab_size).double()[None]
    q = torch.nn.functional.one_hot(draft_ids[0], vocab_size).double()[None]
    uniforms = torch.full((1, k), 0.999)
    for verify in (token_verify, block_verify):
        result = verify(draft_ids, q, p, uniforms, torch.tensor([0.5]))
        assert int(result.num_accepted) == 2
        assert int(result.next_token_ids) == 3
    tree = spectr_verify(
        draft_ids[:, None].expand(1, 2, k),
        q[:, None].expand(1, 2, k, vocab_size),
        p[:, None].expand(1, 2, k + 1, vocab_size),
        torch.full((1, 2, k), 0.999),
        torch.tensor([0.5]),
    )
    assert int(tree.num_accepted) == 2
    assert int(tree.next_token_ids) == 3


def test_spectr_with_four_drafts_accepts_at_least_as_many_as_one():
    """Same tables, same first draft and uniforms: K = 4 keeps at least as much as K = 1."""
    ids, q, p, gen = random_batch(20000, 4, 3, 6, seed=2)
    # All drafts share the first position's distributions, as drafts from one prefix do.
    q[:, :, 0] = q[:, :1, 0]
    p[:, :, 0] = p[:, :1, 0]
    first = torch.multinomial(q[:, 0, 0], 4, replacement=True, generator=gen)  # i.i.d. from q
    ids[:, :, 0] = first
    uniforms = torch.rand(20000, 4, 3, generator=gen)
    sample_u = torch.rand(20000, generator=gen)
    one = spectr_verify(ids[:, :1], q[:, :1], p[:, :1], uniforms[:, :1], sample_u)
    four = spectr_verify(ids, q, p, uniforms, sample_u)
    mean_one = one.num_accepted.double().mean()
    mean_four = four.num_accepted.double().mean()
    assert mean_four >= mean_one + 0.05, (float(mean_one), float(mean_four))


@pytest.mark.parametrize("name", ["token", "block", "spectr"])
def test_ragged_batch_equals_each_row_verified_alone_with_its_own_k(name):
    """Rows padded to a common k decide exactly as they would alone (same draws)."""
    torch.manual_seed(0)
    batch, width, vocab, num_drafts = 6, 4, 5, 2
    own_k = torch.tensor([0, 1, 2, 3, 4, 2])
    draft_probs = torch.softmax(torch.randn(batch, num_drafts, width, vocab).double() * 2, -1)
    target_probs = torch.softmax(torch.randn(batch, num_drafts, width + 1, vocab).double() * 2, -1)
    draft_ids = torch.multinomial(draft_probs.reshape(-1, vocab), 1).view(batch, num_drafts, width)
    accept = torch.rand(batch, num_drafts, width, dtype=torch.float64)
    sample = torch.rand(batch, dtype=torch.float64)
    if name == "spectr":
        together = spectr_verify(
            draft_ids, draft_probs, target_probs, accept, sample, num_draft_tokens=own_k
        )
    else:
        verify = token_verify if name == "token" else block_verify
        together = verify(
            draft_ids[:, 0],
            draft_probs[:, 0],
            target_probs[:, 0],
            accept[:, 0],
            sample,
            num_draft_tokens=own_k,
        )
    for b in range(batch):
        k = int(own_k[b])
        if k == 0:  # speculation off: a sample from p_1
            expected = sample_from_probs(target_probs[b, 0, 0][None], sample[b : b + 1])
            assert int(together.num_accepted[b]) == 0
            assert int(together.next_token_ids[b]) == int(expected)
            continue
        one = slice(b, b + 1)
        if name == "spectr":
            alone = spectr_verify(
                draft_ids[one, :, :k],
                draft_probs[one, :, :k],
                target_probs[one, :, : k + 1],
                accept[one, :, :k],
                sample[one],
            )
        else:
            alone = verify(
                draft_ids[one, 0, :k],
                draft_probs[one, 0, :k],
                target_probs[one, 0, : k + 1],
                accept[one, 0, :k],
                sample[one],
            )
        assert int(together.num_accepted[b]) == int(alone.num_accepted[0])
        assert int(together.next_token_ids[b]) == int(alone.next_token_ids[0])
        torch.testing.assert_close(
            together.next_token_probs[b], alone.next_token_probs[0], atol=1e-12, rtol=0
        )
