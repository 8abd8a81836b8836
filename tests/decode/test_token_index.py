"""The token index the model-free proposers look continuations up in (pure: no models)."""

from __future__ import annotations

import random

import pytest

from osd.decode.proposers.token_index import SuffixStore, TokenIndex, continuations


def index_of(*documents: list[int], anchor: int = 3) -> TokenIndex:
    index = TokenIndex(anchor)
    for document in documents:
        index.add_document(document)
    return index


def test_the_most_frequent_continuation_of_the_longest_match_is_proposed():
    index = index_of([1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7, 8], [0, 2, 3, 4, 7, 8])
    found = continuations([5, 2, 3, 4], [index], 4)  # matches 3 tokens in all three
    assert found is not None
    assert found.tokens == (7, 8) and found.match == 3 and found.support == 3
    assert found.probs == pytest.approx((2 / 3, 2 / 3))
    longer = continuations([1, 2, 3, 4], [index], 4)  # 4 tokens match the first only
    assert longer is not None
    assert longer.tokens == (5, 6) and longer.match == 4 and longer.probs == (1.0, 1.0)


def test_nothing_is_proposed_without_the_anchor_or_a_budget():
    index = index_of([1, 2, 3, 4, 5])
    assert continuations([7, 2, 3], [index], 4) is None  # (7, 2, 3) never seen
    assert continuations([2, 3], [index], 4) is None  # shorter than the anchor
    assert continuations([1, 2, 3], [index], 0) is None
    assert continuations([1, 2, 3], [], 4) is None


def test_a_continuation_stops_at_a_document_end_and_at_min_prob():
    index = index_of([1, 2, 3, 4])
    assert continuations([1, 2, 3], [index], 8).tokens == (4,)  # the document ended
    split = index_of([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 3, 7])
    assert continuations([1, 2, 3], [split], 8, min_prob=0.3) is None  # 1/4 each
    assert continuations([1, 2, 3], [split], 8, min_prob=0.2).tokens in {(4,), (5,), (6,), (7,)}


def test_the_rows_own_tokens_propose_their_repetition_but_not_their_end():
    own = TokenIndex(3)
    own.extend([5, 6, 7, 8, 5, 6, 7])
    found = continuations(own.tokens.tolist(), [own], 4)
    # (5, 6, 7) occurred once before: 8 then 5, 6, 7 (the run ends where the row ends).
    assert found is not None and found.tokens == (8, 5, 6, 7)
    loop = TokenIndex(3)
    loop.extend([9] + [4] * 6)
    # A loop of one token: the longest match has one token after it, shorter ones go on (the
    # earliest (4, 4, 4) ends three tokens before the row's end).
    assert continuations(loop.tokens.tolist(), [loop], 5).tokens == (4, 4, 4)


def test_later_indexes_are_searched_first_within_the_place_budget():
    old = index_of([1, 2, 3, 4])
    new = index_of([1, 2, 3, 5])
    found = continuations([1, 2, 3], [old, new], 2, max_places=1)
    assert found is not None and found.tokens == (5,)
    both = continuations([1, 2, 3], [old, new], 2, max_places=8)
    assert both is not None and both.support == 2


def test_incremental_extension_indexes_what_a_whole_document_would():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    whole, pieces = TokenIndex(3), TokenIndex(3)
    whole.extend(tokens)
    start = 0
    while start < len(tokens):
        size = rng.randrange(1, 9)
        pieces.extend(tokens[start : start + size])
        start += size
    assert whole.tokens.tolist() == pieces.tokens.tolist()
    for _ in range(50):
        end = rng.randrange(3, len(tokens))
        gram = tokens[end - 3 : end]
        assert whole.places(gram, 1000).tolist() == pieces.places(gram, 1000).tolist()


def test_the_store_forgets_its_oldest_segment_past_the_budget():
    store = SuffixStore(budget=100, anchor=3, segments=4)
    for i in range(40):
        store.add([100 + i, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert store.num_tokens <= 100
    assert store.documents == 40
    found = continuations([139, 1, 2], store.segments, 3)  # the newest is kept
    assert found is not None and found.tokens == (3, 4, 5)
    assert continuations([100, 1, 2], store.segments, 3) is None  # the oldest is gone
    assert store.nbytes() > 0
    empty = SuffixStore(budget=0)
    empty.add([1, 2, 3, 4])
    assert empty.num_tokens == 0
    with pytest.raises(ValueError):
        SuffixStore(budget=-1)
    with pytest.raises(ValueError):
        TokenIndex(anchor=0)


def reference_continuations(
    context, indexes, max_tokens, max_match=32, max_places=64, min_prob=0.1
):
    """The walk as the docstring says it, one place and one depth at a time."""
    anchor = indexes[0].anchor
    if max_tokens <= 0 or len(context) < anchor:
        return None
    places = []  # (match length, tokens after), later indexes first, oldest first within
    room = max_places
    for index in reversed(indexes):
        if room <= 0:
            break
        buffer = index.buffer.tolist()
        found = index.places(context[-anchor:], room).tolist()
        room -= len(found)
        for p in found:
            n = 0
            while n < min(max_match, len(context)) and p - n >= 0:
                if buffer[p - n] != context[len(context) - 1 - n]:
                    break
                n += 1
            after = [buffer[min(p + i, len(buffer) - 1)] for i in range(1, max_tokens + 1)]
            places.append((n, after))
    if not places:
        return None
    alive, path, probs, cumulative = places, [], [], 1.0
    for depth in range(max_tokens):
        alive = [(n, f) for n, f in alive if f[depth] >= 0]
        if not alive:
            break
        top = max(n for n, _ in alive)
        votes = [f[depth] for n, f in alive if n == top]
        token = max(dict.fromkeys(votes), key=votes.count)  # ties: the first voted
        cumulative *= votes.count(token) / len(votes)
        if cumulative < min_prob:
            break
        path.append(token)
        probs.append(cumulative)
        alive = [(n, f) for n, f in alive if f[depth] == token]
    best = max(n for n, _ in places)
    support = sum(n == best for n, _ in places)
    return (tuple(path), tuple(probs), best, support) if path else None


@pytest.mark.parametrize("seed", range(6))
def test_the_vectorised_walk_proposes_what_the_walk_one_place_at_a_time_does(seed):
    """Small vocabularies: many places, ties, loops, documents ending mid-walk."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 4, 6, 12])
    anchor = rng.choice([1, 2, 3])
    store = SuffixStore(budget=rng.choice([60, 400, 5000]), anchor=anchor)
    for _ in range(rng.randrange(1, 60)):
        store.add([rng.randrange(vocab) for _ in range(rng.randrange(2, 40))])
    compared = 0
    for _ in range(150):
        own = TokenIndex(anchor)
        context = [rng.randrange(vocab) for _ in range(rng.randrange(anchor, 50))]
        own.extend(context)
        indexes = [*store.segments, own] if rng.random() < 0.8 else [own]
        settings = dict(
            max_match=rng.choice([4, 32]),
            max_places=rng.choice([1, 5, 64]),
            min_prob=rng.choice([0.0, 0.1, 0.5]),
        )
        k = rng.randrange(0, 10)
        found = continuations(context, indexes, k, **settings)
        expected = reference_continuations(context, indexes, k, **settings)
        got = None if found is None else (found.tokens, found.probs, found.match, found.support)
        assert got == (
            None if expected is None else (*expected[:1], pytest.approx(expected[1]), *expected[2:])
        )
        compared += expected is not None
    assert compared > 20
