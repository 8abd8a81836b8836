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

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Continuation", "SuffixStore", "TokenIndex", "continuations"]

_SEPARATOR = -1  # closes a document: equal to no token, so no match runs across it


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
        return dataclasses.replace(self, tokens=self.tokens[:k], probs=self.probs[:k])

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

    def ends_of(self, gram: Sequence[int], most: int) -> list[int]:
        """The last ``most`` positions where ``gram`` (an anchor-gram) ends, oldest first."""
        found = self._ends.get(_key(gram))
        if found is None:
            return []
        return [found] if isinstance(found, int) else found[-most:].tolist()

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
    backward = np.asarray(context[-max_match:][::-1], dtype=np.int64)  # (M,) last token first
    steps = np.arange(len(backward))
    ahead = np.arange(1, max_tokens + 1)
    lengths, follow = [], []
    room = max_places
    for index in reversed(indexes):
        if room <= 0:
            break
        places = [p for p in index.ends_of(gram, room) if p + 1 < index.size]
        if not places:
            continue
        room -= len(places)
        where = np.asarray(places, dtype=np.int64)[:, None]
        # Position 0 holds a separator and the buffer ends in them, so clipped reads match
        # nothing and a continuation stops at the index's end.
        buffer = index.buffer
        seen = np.take(buffer, where - steps, mode="clip")  # (P, M)
        lengths += np.cumprod(seen == backward, axis=1).sum(axis=1).tolist()
        follow += np.take(buffer, where + ahead, mode="clip").tolist()  # (P, k)
    if not lengths:
        return None
    best = max(lengths)
    alive = list(zip(lengths, follow, strict=True))
    support = lengths.count(best)
    path: list[int] = []
    probs: list[float] = []
    cumulative = 1.0
    for depth in range(max_tokens):
        # Places whose text ends here (a finished document, or the row's own end) say nothing
        # about what follows; of the others, those of the longest match vote (a shorter match
        # speaks only where every longer one has ended: a loop in the row's own output).
        alive = [(n, f) for n, f in alive if f[depth] >= 0]
        if not alive:
            break
        top = max(n for n, _ in alive)
        counts: dict[int, int] = {}
        for n, f in alive:
            if n == top:
                counts[f[depth]] = counts.get(f[depth], 0) + 1
        token = max(counts, key=counts.__getitem__)
        cumulative *= counts[token] / sum(counts.values())
        if cumulative < min_prob:
            break
        path.append(token)
        probs.append(cumulative)
        alive = [(n, f) for n, f in alive if f[depth] == token]
    if not path:
        return None
    return Continuation(tuple(path), tuple(probs), best, support)
