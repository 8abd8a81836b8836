"""Topics of unlabeled traffic: which domain adapter learns from a record that names no domain.

A record without a `domain` label is scored by every adapter that has a version (its mean
acceptance lower bound under each, from the logged target distributions: `trainer.routing`).
`TopicMap.assign` then decides which domain adapter, if any, trains on it besides the general
one:

1. the domain adapter with the best score, when one beats the general adapter and the record
   is not served poorly (its best score is not below the median of recent records' by
   `margin`): the adapter that serves it well learns more of it;
2. else the **topic** whose centroid (mean prompt features, `osd.routing.features`) is nearest,
   if the cosine is at least `similarity`: a topic whose adapter has no good version yet keeps
   collecting its records;
3. else, if the record is served poorly, it joins the **pool** of such records (a domain
   adapter that beats the general one by a little on a new topic, say a code adapter on SQL,
   must not take it over); once the pool holds `min_records`
   records that hang together (their mean cosine to the pool's centroid, `|sum| / n` for unit
   vectors, is at least `similarity`), they open a new topic on a **free** domain adapter (one no
   client labels and no topic holds) and go to that adapter at once. A pool that does not hang
   together drops its oldest half (scattered stragglers are no topic);
4. else the general adapter alone.

Pairwise cosines of short prompts are low even within a topic (one code prompt shares few
tokens with the next), but a centroid of a dozen averages that out: hence one pool and a
coherence test rather than clustering record by record. Two new topics that arrive interleaved
open one topic between them (a limit: the router then learns that one adapter serves both).

So a shift to unlabeled traffic no adapter knows (code after prose) opens an adapter for it after
`min_records` records, like a labelled domain's first version; traffic the general adapter serves
well opens none. Pure: numpy and the standard library.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median

import numpy as np
import numpy.typing as npt

__all__ = ["Topic", "TopicMap"]


@dataclass
class Topic:
    """A cluster of prompts: the sum of their unit feature vectors, and their keys."""

    adapter: str = ""  # "" while pending
    total: npt.NDArray[np.float32] | None = None
    members: list[Hashable] = field(default_factory=list)

    def similarity(self, features: npt.NDArray[np.float32]) -> float:
        if self.total is None:
            return 0.0
        norm = float(np.linalg.norm(self.total))
        return float(features @ self.total) / norm if norm else 0.0

    def add(self, key: Hashable, features: npt.NDArray[np.float32], keep: int) -> None:
        self.total = features.copy() if self.total is None else self.total + features
        self.members.append(key)
        del self.members[:-keep]


class TopicMap:
    """Assigns unlabeled records to domain adapters (see the module docstring).

    Args:
        free: the domain adapters topics may take, in the order they are taken.
        general: the general adapter's name.
        similarity: least cosine of a prompt to a topic's centroid.
        min_records: poorly served records of one cluster that open a topic.
        margin: how far below the recent median score a record counts as served poorly.
        window: recent scores the median is taken over.
        discover: False: never open topics (steps 2 and 3 are skipped).
    """

    def __init__(
        self,
        free: Sequence[str],
        general: str,
        *,
        similarity: float = 0.25,
        min_records: int = 16,
        margin: float = 0.15,
        window: int = 256,
        discover: bool = True,
    ) -> None:
        self.free, self.general = list(free), general
        self.similarity, self.min_records, self.margin = similarity, min_records, margin
        self.discover = discover
        self.topics: dict[str, Topic] = {}
        self._pool: deque[tuple[Hashable, npt.NDArray[np.float32]]] = deque()
        self._best: deque[float] = deque(maxlen=window)

    def claim(self, adapter: str) -> None:
        """`adapter` serves labelled traffic: no topic may take it."""
        if adapter in self.free:
            self.free.remove(adapter)

    def baseline(self) -> float | None:
        """Median best score of recent records (None until `min_records` were scored)."""
        return median(self._best) if len(self._best) >= self.min_records else None

    def assign(
        self, key: Hashable, features: npt.NDArray[np.float32], scores: Mapping[str, float]
    ) -> tuple[str, list[Hashable]]:
        """The domain adapter that learns from one unlabeled record ("" for the general one
        alone), and the earlier records a topic opened now takes (empty unless one opened).

        Args:
            key: identifies the record in the returned lists.
            features: its prompt's unit feature vector.
            scores: adapter -> the record's score, for the adapters with a version (the
                general adapter's score is always there).
        """
        best = max(scores, key=lambda name: (scores[name], name == self.general))
        baseline = self.baseline()
        self._best.append(scores[best])
        novel = baseline is not None and scores[best] < baseline - self.margin
        if best != self.general and not novel:
            self._join(best, key, features)
            return best, []
        near = self._nearest(self.topics.values(), features)
        if near is not None:
            near.add(key, features, self.min_records)
            return near.adapter, []
        if not self.discover or not novel:
            return "", []
        self._pool.append((key, features))
        if len(self._pool) < self.min_records or not self.free:
            return "", []
        topic = Topic(self.free[0])
        for member, vector in self._pool:
            topic.add(member, vector, len(self._pool))
        assert topic.total is not None
        if float(np.linalg.norm(topic.total)) / len(self._pool) < self.similarity:
            for _ in range(len(self._pool) // 2):  # scattered: keep the newest half
                self._pool.popleft()
            return "", []
        self._pool.clear()
        self.topics[self.free.pop(0)] = topic
        return topic.adapter, topic.members[:-1]

    def _join(self, adapter: str, key: Hashable, features: npt.NDArray[np.float32]) -> None:
        if adapter in self.free:  # a version from before a restart: it serves a topic already
            self.free.remove(adapter)
        self.topics.setdefault(adapter, Topic(adapter)).add(key, features, self.min_records)

    def _nearest(self, topics: Iterable[Topic], features: npt.NDArray[np.float32]) -> Topic | None:
        best, best_sim = None, self.similarity
        for topic in topics:
            sim = topic.similarity(features)
            if sim >= best_sim:
                best, best_sim = topic, sim
        return best
