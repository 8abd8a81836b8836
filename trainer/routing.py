"""The trainer's half of content routing: score records per adapter, assign unlabeled ones to
domain adapters, fit, judge and publish the routing model.

Labels come for free: for each logged record, the target's logged distributions say how much of
each adapter's draft it would have accepted (`DraftTrainer.record_acceptance`, the mean lower
bound of `sum_x min(p, q)` over its generated positions). The adapter with the best score is the
record's label; the routing model (`osd.routing.model`) learns to predict it from the prompt.

Test, then train, as for adapters: a candidate is fit on older records and judged on the newest
quarter of each domain's window (the newest `routing.window` records of each domain adapter's
records, and of the general adapter's alone, so that a long shift to one domain does not push
the others out of what the router knows) by the **routed acceptance**,
the mean score of the adapter it picks per record; it is published (`osd.routing.store`) when
that beats the current model's on the same records by `routing.publish_margin`, or when there is
none. Scores are recomputed for an adapter whose version changed since (its labels would be
stale), at most `RESCORE_PER_FIT` records per fit, the same share from each domain's window; a
record keeps its older scores until then (one never scored under a candidate sits out).
Replicas roll a published model back when its requests do worse (`serving.router_trial`); the
trainer then judges against the version they went back to.

Unlabeled records are assigned to domain adapters by `trainer.topics.TopicMap`. Routing accuracy
(the share of the unlabeled records scored since the previous point whose serving adapter scored
within `SERVED_TOLERANCE` of the best; adapters of near-equal scores are both right) and regret
(how far below the best the served adapter's score was) go to the stats list
(`osd.routing.store.RoutingStats`), the tracker and the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from osd.config import RoutingConfig
from osd.routing.features import prompt_features
from osd.routing.model import RoutingModel, fit_routing_model
from osd.routing.store import RoutingStats, RoutingStore
from osd.versions.errors import PublishConflict, StoreError
from trainer.examples import Example, window_key
from trainer.replay import DomainWindows
from trainer.topics import TopicMap

__all__ = ["RouteSample", "RoutingTrainer"]

_log = logging.getLogger(__name__)
MIN_FIT_RECORDS = 8
# Records re-scored per fit after a new adapter version made their scores stale (every window
# at every publish took ~2 s of the demo trainer's CPU); the others keep their older scores.
RESCORE_PER_FIT = 64
SERVED_TOLERANCE = 0.02  # a served adapter this close to the best score counts as a best one


@dataclass
class RouteSample:
    """One logged record as the router sees it."""

    example: Example
    features: npt.NDArray[np.float32]
    unlabeled: bool
    scores: dict[str, tuple[int | None, float]] = field(default_factory=dict)  # (version, score)
    window: str = ""  # the domain whose window keeps it (its label's, or its assigned adapter's)

    def label(self, candidates: Sequence[str]) -> str:
        """The candidate with the best score (the first, the general adapter, on ties)."""
        return max(candidates, key=lambda a: self.scores[a][1] if a in self.scores else -1.0)

    def score(self, adapter: str, general: str) -> float:
        """The score of `adapter` (the general one's when it has none: it would serve as base)."""
        return self.scores.get(adapter, self.scores[general])[1]


class RoutingTrainer:
    """Fits and publishes the routing model; assigns unlabeled records to domain adapters.

    Args:
        adapters: the configured adapters, general first.
        score: (adapter, records) -> each record's score under the adapter's current version.
        versions: adapter -> its current version (None: none yet), read live.
        config: `routing` settings.
        store: where models are published (None: fit and judge only, e.g. in tests).
        name: the model's name in `store` (`osd.routing.store.routing_model_name`).
        stats: where routing-accuracy points go (None: the log only).
        keep_versions, gc_grace_s: the store's bounded history after each publish
            (`adapters.keep_versions`, `adapters.gc_grace_s`, as for the adapters).
        min_records: records of one new topic that open a domain adapter for it.
    """

    def __init__(
        self,
        adapters: Sequence[str],
        score: Callable[[str, list[Any]], list[float]],
        versions: Mapping[str, int | None],
        config: RoutingConfig,
        store: RoutingStore | None = None,
        *,
        name: str = "log",
        stats: RoutingStats | None = None,
        keep_versions: int = 4,
        gc_grace_s: float = 60.0,
        min_records: int = 16,
    ) -> None:
        self.adapters = list(adapters)
        self.general, *self.domains = adapters
        self.score_fn, self.versions, self.cfg, self.store = score, versions, config, store
        self.name, self.stats = name, stats
        self.keep_versions, self.gc_grace_s = keep_versions, gc_grace_s
        self.topics = TopicMap(
            self.domains,
            self.general,
            similarity=config.topic_similarity,
            min_records=min_records,
            margin=config.novelty_margin,
            discover=config.discover,
        )
        # The newest `routing.window` records of each domain (the general adapter's: ""), so a
        # long shift does not push a quieter domain's prompts out of what the router knows.
        self.windows = DomainWindows[RouteSample](
            config.window, len(self.adapters), key=lambda s: s.window
        )
        self._recent: dict[str, Example] = {}  # unlabeled examples a topic may still take
        self.model: RoutingModel | None = None
        self.version: int | None = None
        self._since_fit = 0
        # Unlabeled records since the last point: served by a best adapter, and by how much the
        # served adapter's score fell short of the best one's (None: an adapter with no score).
        self._served: list[bool] = []
        self._regret: list[float] = []
        self.last_metrics: dict[str, float] = {}
        self._resume()

    def _resume(self) -> None:
        if self.store is None:
            return
        try:
            self._load(self.store.current(self.name))
        except StoreError as exc:
            _log.warning("routing model: cannot load the current one (%s); fitting anew", exc)

    def _load(self, version: int | None) -> None:
        self.version = version
        self.model = None
        if version and self.store is not None:  # None or 0 (rolled back past the first): none
            self.model = self.store.load(self.name, version)[1]

    def candidates(self) -> list[str]:
        """The general adapter and every domain adapter with a version."""
        return [self.general] + [a for a in self.domains if self.versions.get(a) is not None]

    # Records in.

    def observe(
        self, examples: Sequence[Example]
    ) -> tuple[dict[str, str], list[tuple[Example, str]]]:
        """Takes newly read records.

        Returns:
            `(assigned, taken)`: entry id -> the domain adapter that also learns from it ("":
            none), for each unlabeled one of `examples` (a labelled record's label decides);
            and earlier records a topic opened now takes, with that topic's adapter.
        """
        samples = []
        for example in examples:
            record = example.record
            if record.domain in self.domains:
                self.topics.claim(record.domain)
            sample = RouteSample(
                example, prompt_features(record.token_ids[: record.prompt_len]), not record.domain
            )
            samples.append(sample)
            if not sample.unlabeled:
                self._remember(sample, window_key(record, self.adapters))
        self._since_fit += len(samples)
        unlabeled = [s for s in samples if s.unlabeled]
        assigned: dict[str, str] = {}
        taken: list[tuple[Example, str]] = []
        if not unlabeled or not self.cfg.enabled or not self.domains:  # nothing to route to
            for sample in unlabeled:
                self._remember(sample, "")
                assigned[sample.example.entry_id] = ""
            return assigned, taken
        candidates = self.candidates()
        for adapter in candidates[1:]:  # a version (e.g. from before a restart) is no free slot
            if adapter not in self.topics.topics:
                self.topics.claim(adapter)
        self._refresh(unlabeled, candidates)
        for sample in unlabeled:
            entry = sample.example.entry_id
            scores = {a: sample.scores[a][1] for a in candidates}
            self._note_served(sample.example.record.adapter_name, scores)
            domain, earlier = self.topics.assign(entry, sample.features, scores)
            self._remember(sample, domain)
            assigned[entry] = domain
            taken += [(self._recent[k], domain) for k in earlier if k in self._recent]
            self._recent[entry] = sample.example
        while len(self._recent) > self.cfg.window:
            del self._recent[next(iter(self._recent))]
        return assigned, taken

    def _remember(self, sample: RouteSample, domain: str) -> None:
        sample.window = domain
        self.windows.append(sample)

    def _rescore(self, candidates: Sequence[str]) -> None:
        """Scores up to `RESCORE_PER_FIT` records under candidates' current versions, the same
        share from each domain's window, newest first, those with no score of some candidate
        before those with an old one: a busy domain must not starve the others' labels."""
        windows = self.windows.by_domain().values()
        share = max(1, RESCORE_PER_FIT // max(1, len(windows)))
        picked: list[RouteSample] = []
        for window in windows:
            due = [s for s in reversed(window) if not self._current(s, candidates)]
            due.sort(key=lambda s: all(a in s.scores for a in candidates))  # stable
            picked += due[:share]
        self._refresh(picked, candidates)

    def _current(self, sample: RouteSample, candidates: Sequence[str]) -> bool:
        """Whether `sample` has a score of every candidate's current version."""
        return all(sample.scores.get(a, (-1, 0.0))[0] == self.versions.get(a) for a in candidates)

    def _refresh(self, samples: Sequence[RouteSample], candidates: Sequence[str]) -> None:
        """Scores `samples` under each candidate whose version they were not scored with."""
        for adapter in candidates:
            version = self.versions.get(adapter)
            stale = [s for s in samples if s.scores.get(adapter, (-1, 0.0))[0] != version]
            if not stale:
                continue
            scores = self.score_fn(adapter, [s.example.record for s in stale])
            for sample, score in zip(stale, scores, strict=True):
                sample.scores[adapter] = (version, float(score))

    # The model.

    def maybe_fit(self) -> str | None:
        """Fits, judges and maybe publishes a candidate once `fit_every` records came since the
        last; returns the outcome ("published", "refused", "conflict", "unavailable", "waiting")
        or None when not due."""
        if not self.cfg.enabled or not self.domains or self._since_fit < self.cfg.fit_every:
            return None
        self._since_fit = 0
        candidates = self.candidates()
        if not any(s.unlabeled for s in self.windows):
            return None  # labelled traffic routes itself: no scoring cost
        if len(candidates) < 2:
            return "waiting"  # nothing to choose between
        started = time.perf_counter()
        self._follow_pointer()
        self._rescore(candidates)
        train, test = [], []
        for window in self.windows.by_domain().values():  # each domain's newest quarter judges
            scored = [s for s in window if all(a in s.scores for a in candidates)]
            held = len(scored) // 4
            train += scored[: len(scored) - held]
            test += scored[len(scored) - held :]
        if len(train) < MIN_FIT_RECORDS or len(test) < 4:
            return "waiting"  # too little to fit or judge on
        features = np.stack([s.features for s in train])
        candidate = fit_routing_model(features, [s.label(candidates) for s in train], candidates)
        chosen = candidate.choices(np.stack([s.features for s in test]))
        new = self._routed(test, chosen)
        old = None if self.model is None else self._routed(test, self._choices(self.model, test))
        outcome = "refused"
        if old is None or new > old + self.cfg.publish_margin:
            outcome = self._publish(candidate, new)
        labels = [s.label(candidates) for s in test]
        self._point(
            outcome,
            routed=new,
            current=old,
            model_accuracy=float(np.mean([a == b for a, b in zip(chosen, labels, strict=True)])),
            fit_s=time.perf_counter() - started,
        )
        return outcome

    def _follow_pointer(self) -> None:
        """Judges against the version replicas serve: one may have rolled ours back."""
        if self.store is None:
            return
        try:
            pointer = self.store.current(self.name)
            if pointer != self.version:
                _log.info("routing model: the pointer is at v%s, not v%s", pointer, self.version)
                self._load(pointer)
        except StoreError as exc:
            _log.warning("routing model: cannot read the pointer (%s)", exc)

    @staticmethod
    def _choices(model: RoutingModel, samples: Sequence[RouteSample]) -> list[str]:
        return model.choices(np.stack([s.features for s in samples]))

    def _routed(self, samples: Sequence[RouteSample], chosen: Sequence[str]) -> float:
        """Mean score of the adapter chosen per record (routed acceptance)."""
        return float(
            np.mean([s.score(a, self.general) for s, a in zip(samples, chosen, strict=True)])
        )

    def _publish(self, model: RoutingModel, score: float) -> str:
        if self.store is None:
            self.model = model
            return "published"
        try:
            manifest = self.store.publish(
                self.name, model, expected_current=self.version, score=score
            )
        except PublishConflict as exc:  # a replica rolled ours back: judge against theirs
            _log.info("routing model: %s; judging against it from now on", exc)
            try:
                self._load(exc.actual)
            except StoreError as load_exc:
                _log.warning("routing model: cannot load v%s (%s)", exc.actual, load_exc)
            return "conflict"
        except StoreError as exc:
            _log.warning("routing model: cannot publish (%s); trying again later", exc)
            return "unavailable"
        self.version, self.model = manifest.version, model
        try:
            self.store.collect_garbage(
                self.name, keep_versions=self.keep_versions, grace_s=self.gc_grace_s
            )
        except StoreError as exc:
            _log.warning("routing model: old versions not collected (%s)", exc)
        return "published"

    def _note_served(self, served: str, scores: Mapping[str, float]) -> None:
        """Routing accuracy: whether the adapter that served a record was a best one (within
        `SERVED_TOLERANCE` of the best score: near-ties are no routing error), and its regret."""
        best = max(scores.values())
        self._served.append(served in scores and scores[served] >= best - SERVED_TOLERANCE)
        if served in scores:
            self._regret.append(best - scores[served])

    def _point(self, outcome: str, **numbers: float | None) -> None:
        served = float(np.mean(self._served)) if self._served else None
        point = {
            "time": time.time(),
            "outcome": outcome,
            "version": self.version,
            "served_accuracy": served,
            "served_regret": float(np.mean(self._regret)) if self._regret else None,
            "served_records": len(self._served),
            "topics": {a: len(t.members) for a, t in self.topics.topics.items()},
            **numbers,
        }
        self._served, self._regret = [], []
        self.last_metrics = {
            f"routing/{k}": float(v) for k, v in point.items() if isinstance(v, int | float)
        }
        _log.info("routing %s", {k: v for k, v in point.items() if k != "time"})
        if self.stats is not None:
            try:
                self.stats.add(point)
            except StoreError as exc:
                _log.warning("routing stats not written: %s", exc)

    def close(self) -> None:
        for part in (self.store, self.stats):
            if part is not None:
                part.close()
