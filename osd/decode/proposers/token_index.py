"""Token sequences indexed by their n-grams: what the model-free proposers look continuations up in.

A :class:`TokenIndex` holds sequences of token ids back to back (each document closed by a
separator that matches no token) and, for every position, where the ``anchor``-gram ending there
occurs, so the places a row's last ``anchor`` tokens occurred before are one dict lookup away.
:func:`continuations` then measures, for each such place, how many more tokens before it agree
with the row's context (the match length), keeps the places of the longest match, and walks their
continuations token by token: at each depth the most frequent next token among the places still
agreeing with the path, with its share of them as the empirical probability. That is suffix
decoding's proposal (the most frequent continuation of the longest matching suffix, as
ArcticInference's suffix tree gives it) computed from a flat index instead of a tree: one int32
per token plus a list entry per position, and no rebuilding.

A :class:`SuffixStore` bounds the memory: documents go into the newest of a few segments, and
when the tokens held pass the budget the oldest segment is dropped whole (oldest forgotten first).
Pure: numpy and the standard library.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Continuation", "SuffixStore", "TokenIndex", "continuations"]

_SEPARATOR = -1  # closes a document: equal to no token, so no match runs across it
_NO_PLACES = np.zeros(0, dtype=np.int32)
_NEVER = -2  # matches no token and no separator


@dataclass(frozen=True)
class Continuation:
    """A proposed continuation and how likely the places it was read from make each prefix.

    Attributes:
        tokens: the proposed tokens, in order.
        probs: the cumulative empirical probability of each prefix: tokens[0..i] all follow
            (the share of the matching places that continue with them).
        match: tokens of context the places matched (the suffix's length).
        support: places of that longest match.
    """

    tokens: tuple[int, ...]
    probs: tuple[float, ...]
    match: int
    support: int

    def cut(self, k: int) -> Continuation:
        """The first ``k`` tokens (a row's or the batch's budget)."""
        return Continuation(self.tokens[:k], self.probs[:k], self.match, self.support)

    @property
    def score(self) -> float:
        """Expected tokens accepted if every place were as likely as the next: sum of probs."""
        return float(sum(self.probs))


class TokenIndex:
    """Token sequences with, for each ``anchor``-gram, the positions where it ends.

    Args:
        anchor: n of the n-grams looked up (a shorter context never proposes).
    """

    def __init__(self, anchor: int = 3) -> None:
        if anchor < 1:
            raise ValueError(f"anchor must be >= 1, got {anchor}")
        self.anchor = anchor
        # Position 0 is a separator, and the buffer always has one spare at its end.
        self._tokens = np.full(256, _SEPARATOR, dtype=np.int64)
        self.size = 1  # positions used (tokens and separators)
        # anchor-gram (packed: _key) -> where it ends: an int while once, then 4 bytes a position
        self._ends: dict[int, int | array[int]] = {}
        self._open = 1  # where the open document began

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        """The tokens and separators held (after the leading separator)."""
        return self._tokens[1 : self.size]

    @property
    def buffer(self) -> npt.NDArray[np.int64]:
        """The whole buffer: a separator first and at least one after the last token."""
        return self._tokens

    def __len__(self) -> int:
        return self.size - 1

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends tokens to the open document and indexes the n-grams they complete."""
        count = len(tokens)
        if not count:
            return
        self._reserve(count)
        start = self.size
        self._tokens[start : start + count] = tokens
        self.size += count
        n, ends = self.anchor, self._ends
        listed = self._tokens[max(self._open, start - n + 1) : self.size].tolist()
        first = max(self._open, start - n + 1)
        for i in range(max(n - 1, start - first), len(listed)):
            key = _key(listed[i - n + 1 : i + 1])
            found = ends.get(key)
            if found is None:
                ends[key] = first + i
            elif isinstance(found, int):
                ends[key] = array("i", (found, first + i))
            else:
                found.append(first + i)

    def close(self) -> None:
        """Ends the open document (its continuations stop here; no n-gram spans it)."""
        self._reserve(1)
        self._tokens[self.size] = _SEPARATOR
        self.size += 1
        self._open = self.size

    def _reserve(self, count: int) -> None:
        if self.size + count >= len(self._tokens):
            grown = np.full(max(2 * len(self._tokens), self.size + count + 1), _SEPARATOR, np.int64)
            grown[: self.size] = self._tokens[: self.size]
            self._tokens = grown

    def add_document(self, tokens: Sequence[int]) -> None:
        self.extend(tokens)
        self.close()

    def places(self, gram: Sequence[int], most: int) -> npt.NDArray[np.int32]:
        """The last ``most`` positions where ``gram`` (an anchor-gram) ends, oldest first, less
        the index's last position (nothing follows it yet)."""
        found = self._ends.get(_key(gram))
        if found is None:
            return _NO_PLACES
        if isinstance(found, int):
            return _NO_PLACES if found + 1 >= self.size else np.array([found], dtype=np.int32)
        # A copy: a view would keep extend() from growing the array while it is held.
        where = np.frombuffer(found, dtype=np.int32)[-most:].copy()  # positions only grow
        return where[:-1] if where[-1] + 1 >= self.size else where

    def nbytes(self) -> int:
        """Approximate memory: the token array, the position lists and the dict's entries."""
        import sys

        lists = sum(sys.getsizeof(v) for v in self._ends.values())  # ints and arrays
        keys = len(self._ends) * (sys.getsizeof(1 << 62) + 72)  # a key and its dict slot
        return int(self._tokens.nbytes + lists + keys)


class SuffixStore:
    """Finished requests' tokens within a token budget, oldest forgotten first.

    Args:
        budget: tokens held at most (0: nothing is kept).
        anchor: as :class:`TokenIndex`.
        segments: the budget is split into this many segments; when full, the oldest goes.
    """

    def __init__(self, budget: int, anchor: int = 3, segments: int = 4) -> None:
        if budget < 0 or segments < 1:
            raise ValueError(f"need budget >= 0 and segments >= 1, got {budget}, {segments}")
        self.budget, self.anchor = budget, anchor
        self._segment_size = max(1, budget // segments)
        self.segments: list[TokenIndex] = []
        self.documents = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def add(self, tokens: Sequence[int]) -> None:
        """Learns one finished request's prompt and output."""
        if self.budget == 0 or len(tokens) < self.anchor + 1:
            return
        tokens = tokens[-self.budget :]
        if not self.segments or len(self.segments[-1]) + len(tokens) > self._segment_size:
            self.segments.append(TokenIndex(self.anchor))
        self.segments[-1].add_document(tokens)
        self.documents += 1
        while self.num_tokens > self.budget and len(self.segments) > 1:
            self.segments.pop(0)

    def prepend(self, older: SuffixStore) -> None:
        """Puts ``older``'s segments before this store's, keeping the budget (the oldest
        go first). One list operation: another thread may be adding meanwhile."""
        room = self.budget - self.num_tokens
        kept: list[TokenIndex] = []
        for segment in reversed(older.segments):
            if len(segment) > room:
                break
            kept.insert(0, segment)
            room -= len(segment)
        self.segments[0:0] = kept
        self.documents += older.documents

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.segments)


def _key(gram: Sequence[int]) -> int:
    """An anchor-gram as one int (21 bits a token: every vocabulary in use fits)."""
    key = 0
    for token in gram:
        key = (key << 21) | token
    return key


def continuations(
    context: Sequence[int],
    indexes: Sequence[TokenIndex],
    max_tokens: int,
    *,
    max_match: int = 32,
    max_places: int = 64,
    min_prob: float = 0.1,
) -> Continuation | None:
    """The most frequent continuation of the longest suffix of ``context`` found in ``indexes``.

    Args:
        context: the row's tokens so far (its last ``anchor`` must have occurred before).
        indexes: where to look (the row's own tokens, finished requests' ...); a place at the
            very end of an index (the context itself, for the row's own index) has no
            continuation and is skipped.
        max_tokens: the longest continuation proposed.
        max_match: context tokens compared at most (longer matches count as this long).
        max_places: the most recent places of the anchor-gram compared, over all indexes
            (the later indexes first: pass them oldest first).
        min_prob: the walk stops before a token whose cumulative probability falls below this.

    Returns:
        None where nothing matches or ``max_tokens`` is 0.
    """
    if max_tokens <= 0 or not indexes:
        return None
    anchor = indexes[0].anchor
    if len(context) < anchor:
        return None
    gram = [int(t) for t in context[-anchor:]]
    # (M + 1,): the last M tokens, last first, then one that matches nothing (so the first
    # mismatch of a place is where its match ends, found by one argmax)
    backward = np.asarray([*context[-max_match:][::-1], _NEVER], dtype=np.int64)
    offsets = _offsets(len(backward) - 1, max_tokens)
    reads: list[npt.NDArray[np.int64]] = []
    room = max_places
    for index in reversed(indexes):
        if room <= 0:
            break
        where = index.places(gram, room)
        if not len(where):
            continue
        room -= len(where)
        # Position 0 holds a separator and the buffer ends in them, so clipped reads match
        # nothing and a continuation stops at the index's end.
        reads.append(np.take(index.buffer, where[:, None] + offsets, mode="clip"))
    if not reads:
        return None
    read = reads[0] if len(reads) == 1 else np.concatenate(reads)  # (P, M + 1 + k)
    lengths = (read[:, : len(backward)] != backward).argmax(axis=1)  # (P,) tokens matched
    return _walk(lengths, read[:, len(backward) :], max_tokens, min_prob)


@functools.lru_cache(maxsize=256)
def _offsets(match: int, ahead: int) -> npt.NDArray[np.int64]:
    """Where a lookup reads around a place: the ``match`` tokens ending there (last first),
    the place again (compared with a token that matches nothing), then the ``ahead`` after
    it."""
    offsets = np.concatenate([-np.arange(match + 1), np.arange(1, ahead + 1)])
    offsets[match] = 0
    offsets.flags.writeable = False
    return offsets


def _walk(
    lengths: npt.NDArray[np.int64], follow: npt.NDArray[np.int64], max_tokens: int, min_prob: float
) -> Continuation | None:
    """The continuation the places vote for: at each depth, the token most of the places
    still agreeing with the path have next. ``lengths``: each place's match; ``follow``: the
    tokens after it, (P, k), negative past its document's end; places in the order the
    lookup found them.

    Places whose text ends at a depth (a finished document, or the row's own end) say nothing
    about what follows; of the others, those of the longest match vote (a shorter match
    speaks only where every longer one has ended: a loop in the row's own output), ties to
    the token voted first. Depths at which every voter agrees are taken together: no vote
    there changes the probability, and the voters all stay alive, so they stay the voters."""
    best = lengths.max()
    longest = lengths == best
    support = int(np.count_nonzero(longest))
    top = follow[longest]
    if min_prob <= 1 and top[0].min() >= 0 and (top == top[0]).all():
        # Every place of the longest match goes on alike (a prompt asked again).
        return Continuation(tuple(top[0].tolist()), (1.0,) * max_tokens, int(best), support)
    alive = np.arange(len(lengths))  # places agreeing with the path so far
    path: list[int] = []
    probs: list[float] = []
    cumulative = 1.0
    depth = 0
    while depth < max_tokens:
        column = follow[alive, depth]
        ended = column < 0
        if ended.any():
            alive, column = alive[~ended], column[~ended]
            if not len(alive):
                break
        alive_lengths = lengths[alive]
        voting = alive_lengths == alive_lengths.max()
        block = follow[alive[voting], depth:]
        first = block[0]
        same = np.append((block == first).all(axis=0) & (first >= 0), False)
        run = int(same.argmin())  # depths from here at which every voter agrees
        if run:
            if cumulative < min_prob:
                break
            path += first[:run].tolist()
            probs += [cumulative] * run
            depth += run
            if depth < max_tokens:
                alive = alive[(follow[alive, depth - run : depth] == first[:run]).all(axis=1)]
            continue
        votes = column[voting].tolist()
        counts: dict[int, int] = {}
        for token in votes:
            counts[token] = counts.get(token, 0) + 1
        token = max(counts, key=counts.__getitem__)  # ties: the first voted
        cumulative *= counts[token] / len(votes)
        if cumulative < min_prob:
            break
        path.append(token)
        probs.append(cumulative)
        alive = alive[column == token]
        depth += 1
    return Continuation(tuple(path), tuple(probs), int(best), support) if path else None
