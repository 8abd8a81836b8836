"""The model-free proposers: continuations looked up in text already seen.

``suffix``: the request's own prompt and output so far, and the prompts and outputs of the
requests this decoder finished recently (a :class:`SuffixStore` within a token budget), as
suffix decoding does (ArcticInference; vLLM's ``suffix`` method). ``ngram``: the request's own
tokens only, as prompt lookup does (vLLM's ``ngram``). Both propose the most frequent
continuation of the longest matching suffix (:func:`continuations`) with each prefix's empirical
probability, which the goodput controller turns into an expected number of accepted tokens.

Their drafts are deterministic: the verifiers see q one-hot on the proposed token, which keeps
them exact (docs/algorithms.md, "Deterministic drafts"). Lookup runs on the decode thread
(tens of microseconds a row); learning a finished request runs after the step that finished it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from osd.decode.proposers.token_index import Continuation, SuffixStore, TokenIndex, continuations
from osd.decode.rows import Row

__all__ = ["LookupProposer", "SuffixScope"]

SuffixScope = Literal["global", "route"]


class LookupProposer:
    """Proposes continuations of a row's tokens from the row itself and, with ``shared``, from
    finished requests.

    Args:
        name: ``suffix`` or ``ngram`` (the name requests pin and counters use).
        shared: learn finished requests and look in them (suffix decoding); False: the row's
            own tokens only (prompt lookup).
        budget: tokens of finished requests kept (per scope key), oldest forgotten first.
        scope: ``global``: one store for every request; ``route``: one per route (the
            request's domain), so a route's continuations are not crowded out by another's.
        anchor: the shortest context that proposes (n of the n-grams looked up).
        max_match: context tokens compared at most.
        min_prob: the walk stops before a token less likely than this (cumulative).
    """

    def __init__(
        self,
        name: str,
        *,
        shared: bool,
        budget: int = 0,
        scope: SuffixScope = "global",
        anchor: int = 3,
        max_match: int = 32,
        min_prob: float = 0.1,
    ) -> None:
        if scope not in ("global", "route"):
            raise ValueError(f"scope must be 'global' or 'route', got {scope!r}")
        self.name = name
        self.shared = shared
        self.budget = budget
        self.scope = scope
        self.anchor = anchor
        self.max_match = max_match
        self.min_prob = min_prob
        self.stores: dict[str, SuffixStore] = {}

    def store(self, route: str) -> SuffixStore:
        key = route if self.scope == "route" else ""
        if key not in self.stores:
            self.stores[key] = SuffixStore(self.budget, self.anchor)
        return self.stores[key]

    def offer(self, row: Row, limit: int) -> Continuation | None:
        """The continuation this proposer would draft for ``row`` (at most ``limit`` tokens)."""
        own = self._own_index(row)
        indexes: list[TokenIndex] = []
        if self.shared:
            indexes += self.store(row.request.route).segments
        indexes.append(own)  # last: looked at first
        return continuations(
            row.seq,
            indexes,
            limit,
            max_match=self.max_match,
            min_prob=self.min_prob,
        )

    def learn(self, tokens: Sequence[int], route: str = "") -> None:
        """Takes a finished request's prompt and output (nothing for a row-only proposer)."""
        if self.shared:
            self.store(route).add(tokens)

    def warm(self, documents: Sequence[tuple[Sequence[int], str]]) -> None:
        """Earlier requests' tokens and routes, oldest first: built into stores of their own,
        then put before this proposer's (see :meth:`Proposers.warm`)."""
        aside = LookupProposer(
            self.name, shared=True, budget=self.budget, scope=self.scope, anchor=self.anchor
        )
        for tokens, route in documents:
            aside.learn(tokens, route)
        for key, store in aside.stores.items():
            self.store(key).prepend(store)

    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.stores.values())

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.stores.values())

    def _own_index(self, row: Row) -> TokenIndex:
        """The row's own tokens, indexed once and caught up at each lookup (shared by every
        lookup proposer: the row keeps it)."""
        own = row.scratch.get("own_index")
        if own is None or own.anchor != self.anchor:
            own = row.scratch["own_index"] = TokenIndex(self.anchor)
        if len(own) < len(row.seq):
            own.extend(row.seq[len(own) :])
        return own
