"""The online distillation worker: log stream in, judged adapter versions out.

Loop (`TrainerWorker.run`): read records from the log stream as one consumer of
`config.trainer.group`; route each to the adapters that learn from it
(`trainer.examples.adapters_for`), where it first joins the judge's window of its domain and
later, pushed out by newer records, becomes fresh training data (test, then train:
`trainer.replay`). Rounds go to the ready adapter with the largest expected gain
(`trainer.schedule`); a round runs `steps_per_round` steps (half fresh, half replay), then judges
the candidate against the current version on the judge's windows and publishes it with
compare-and-set if it is better by `publish_margin` (`trainer.judge`, `trainer.publisher`). An
adapter with no version yet starts from the best published one and is due a round after about
`2 * min_holdout_records` records; a running round of another adapter yields to it.

Delivery (docs/trainer.md, "Delivery, acknowledgement and restart"): at least once, never twice
after an acknowledgement. A record is acknowledged once every adapter it was routed to trained on
it (an unusable one at once); until then it stays pending in the group, and a restarted worker
(any consumer name) first claims every pending entry, so a crash loses no record, only the
replay windows and candidate progress since the last published version (`Publisher.restore`).
One trainer per consumer group: at start-up it claims all of the group's pending entries. A
pool of workers (`trainer.pool`) runs one `TrainerWorker` per owned adapter on that adapter's
own stream instead.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from osd.adapters.codec import AdapterStore
from osd.buffer.reader import LogReader
from osd.buffer.record import Record
from osd.config import OSDConfig
from osd.threads import threads_applied
from osd.versions.errors import StoreUnavailable
from trainer.draft_trainer import DraftTrainer
from trainer.examples import Example, adapters_for, entry_time
from trainer.heartbeat import Heartbeat
from trainer.judge import judge_domains
from trainer.publisher import Publisher
from trainer.replay import AckTracker, AdapterData, held_for_judging
from trainer.schedule import expected_gain, first_version_due
from trainer.tracking import Tracker
from trainer.worker_stats import RoundReport, WorkerStats

__all__ = [
    "NoRouting",
    "RecordRouter",
    "RoundReport",
    "TrainerWorker",
    "WorkerStats",
    "usable_record",
]

_log = logging.getLogger(__name__)


class RecordRouter(Protocol):
    """Content routing as the worker uses it (`trainer.routing.RoutingTrainer`)."""

    last_metrics: dict[str, float]

    def observe(self, examples: Sequence[Example]) -> tuple[dict[str, str], list[Any]]: ...

    def maybe_fit(self) -> str | None: ...

    def close(self) -> None: ...


class NoRouting:
    """A worker whose records were routed before it read them (a pool member's adapter)."""

    last_metrics: dict[str, float] = {}

    def observe(self, examples: Sequence[Example]) -> tuple[dict[str, str], list[Any]]:
        return {}, []

    def maybe_fit(self) -> str | None:
        return None

    def close(self) -> None:
        pass


_MAX_READ = 256
_MAX_CLAIM = 100_000
# Held-out positions a domain needs before the judge weighs it and guards it against regression
# (fewer: too noisy to tell a 0.01 loss). When no domain has that many, all domains are weighed.
MIN_DOMAIN_POSITIONS = 128


def usable_record(record: Record, vocab_size: int) -> bool:
    """Whether `record` can train a draft of `vocab_size` outputs (a prompt, a generated token,
    every id in range)."""
    if record.prompt_len < 1 or record.num_generated < 1:
        return False
    top = int(record.target_top_ids.max()) if record.target_top_ids.size else 0
    return max(int(record.token_ids.max()), top) < vocab_size


class TrainerWorker:
    """Reads records, trains the adapters, judges and publishes them.

    Built by :func:`trainer.wiring.wire_trainer`, which makes every part from the config; the
    worker builds none.

    Args:
        config: the deployment's config (`model`, `trainer`).
        trainer: the draft trainer (the base draft and the adapters' current / candidate slots).
        store: the adapter store the publisher writes to.
        publisher: judged versions out; its `states` (one `AdapterState` per adapter: windows,
            version, bookkeeping) are the worker's too.
        reader: the log stream, as one consumer of `trainer.group` (a pool member's adapter:
            that adapter's stream).
        routing: content routing's trainer (a pool member's adapter: none, the dispatcher
            routed its records).
        tracker: where round metrics go.
        heartbeat: makes the heartbeat from the worker's progress function.
        owned: the adapters it trains (default: every configured one).
    """

    def __init__(
        self,
        config: OSDConfig,
        *,
        trainer: DraftTrainer,
        store: AdapterStore,
        publisher: Publisher,
        reader: LogReader,
        routing: RecordRouter,
        tracker: Tracker,
        heartbeat: Callable[[Callable[[], tuple[float, float, int, int]]], Heartbeat],
        owned: Sequence[str] | None = None,
    ) -> None:
        cfg = self.cfg = config.trainer
        self.config = config
        # The adapters this worker reads for and trains: all of them, or a pool member's share
        # (`trainer.pool`); records route by the whole configured list either way.
        self.adapters = list(config.model.adapters if owned is None else owned)
        self.trainer, self.store, self.publisher = trainer, store, publisher
        self.reader, self.routing, self.tracker = reader, routing, tracker
        self.vocab_size = int(self.trainer.model.get_output_embeddings().weight.shape[0])
        # One object per adapter: its windows, version and bookkeeping, shared with the
        # publisher (trainer.adapter_state), which may hold other adapters' too.
        self.states = {a: publisher.states[a] for a in self.adapters}
        self.acks = AckTracker()
        self.stats = WorkerStats()
        self.rng = np.random.default_rng(cfg.seed)
        self.fresh_limit = max(cfg.min_records, cfg.steps_per_round * cfg.batch_records)
        self._last_claim = time.monotonic()
        self._claim_all_due = False  # the start-up claim found Redis down: claim all again
        self._stop = threading.Event()  # set by `run`'s caller: rounds end after the step
        # Audit hook after each step: (adapter, entry ids trained on for the first time).
        self.on_trained: Callable[[str, list[str]], None] | None = None
        # The same with the records (a pool's audit names them by request id).
        self.on_trained_records: Callable[[str, list[Record]], None] | None = None
        self.loop_at = time.time()  # the loop last came round (or a step ended): the heartbeat
        self.judging = 0  # entries held only to judge on, as of loop_at (for the heartbeat)
        self.heartbeat = heartbeat(
            lambda: (self.loop_at, self.reader.last_ack_at, self.stats.rounds, self.judging)
        )

    def stop_rounds_on(self, event: threading.Event) -> None:
        """Rounds end after their current step once `event` is set (`run` sets its own)."""
        self._stop = event

    @property
    def data(self) -> dict[str, AdapterData]:
        """Each adapter's record windows (a view for callers; the worker reads ``states``)."""
        return {a: state.data for a, state in self.states.items()}

    def resume(self, *, reload: bool = True) -> None:
        """Loads the published versions (unless `reload` is False: the weights are current),
        then claims every entry the group left pending that it does not hold (a crashed
        predecessor's records, read but not trained on).

        A store that cannot be reached now is no reason to stop: the adapter then trains from
        the base draft, and its first publish (compare-and-set against "no version") conflicts
        and loads the current version (`Publisher.publish`).
        """
        for adapter in self.adapters if reload else ():
            try:
                self.publisher.restore(adapter)
            except StoreUnavailable as exc:
                _log.warning("%s: adapter store unreachable (%s); resuming later", adapter, exc)
        self.stats.claimed += self._claim(0, _MAX_CLAIM)

    def _claim(self, min_idle_ms: int, count: int) -> int:
        """Claims entries pending for ``min_idle_ms`` (0: all, as at start-up); returns how
        many. If Redis did not answer the start-up claim, `ingest` asks again each time until it
        does, rather than leaving those entries to the periodic claim ``claim_idle_ms`` later."""
        accepted = self._accept(self.reader.claim_stale(min_idle_ms, count, held=self.acks))
        if min_idle_ms == 0:
            self._claim_all_due = not self.reader.connected
        return accepted

    # Reading.

    def _usable(self, record: Record) -> bool:
        return usable_record(record, self.vocab_size)

    def _accept(self, entries: list[tuple[str, Record]]) -> int:
        """Routes read entries to their adapters' hold-out windows (whose oldest records become
        fresh), unlabeled ones by content (`trainer.routing`); returns how many."""
        done: list[str] = []
        usable: list[Example] = []
        for entry_id, record in entries:
            if entry_id in self.acks:
                continue  # claimed again while we hold it
            if not self._usable(record):
                self.stats.skipped += 1
                done.append(entry_id)
            else:
                usable.append(Example(entry_id, record, entry_time(entry_id)))
        self.reader.ack(done)
        assigned, taken = self.routing.observe(usable)
        for example in usable:
            self._add(dataclasses.replace(example, domain=assigned.get(example.entry_id)))
        for example, domain in taken:  # a new topic takes earlier records
            if example.entry_id in self.acks:
                self.acks.expect_more(example.entry_id)
            else:  # acknowledged already: trained on without holding it again
                example = dataclasses.replace(example, entry_id="")
            self.states[domain].data.add(dataclasses.replace(example, domain=domain))
        return len(done) + len(usable)

    def _add(self, example: Example) -> None:
        routed = adapters_for(example.record, self.config.model.adapters, example.domain)
        adapters = [a for a in routed if a in self.states]
        if not adapters:  # for none of this worker's adapters (not sent to it by a pool)
            self.stats.skipped += 1
            self.reader.ack([example.entry_id])
            return
        self.acks.expect(example.entry_id, len(adapters))
        for adapter in adapters:
            self.states[adapter].data.add(example)
        self.stats.held_out += 1
        self.stats.by_domain[example.record.domain or example.domain or "-"] += 1

    def ingest(self, block_ms: int = 0) -> int:
        """Reads new records (waiting up to `block_ms` for the first), unless enough fresh
        records wait already; claims entries of dead consumers now and then.

        Returns:
            How many records were read or claimed.
        """
        claimed = read = 0
        idle_ms = self.cfg.claim_idle_ms
        if self._claim_all_due and self.reader.connected:  # the read below finds Redis back
            claimed = self._claim(0, _MAX_CLAIM)
        elif idle_ms and time.monotonic() - self._last_claim > idle_ms / 2e3:
            self._last_claim = time.monotonic()
            claimed = self._claim(idle_ms, _MAX_READ)
        room = self.fresh_limit - max(len(s.data.fresh) for s in self.states.values())
        if room > 0:
            read = self._accept(self.reader.read(count=min(room, _MAX_READ), block_ms=block_ms))
        self.stats.claimed += claimed
        self.stats.read += read
        return claimed + read

    # Training.

    def ready(self, now: float | None = None) -> list[str]:
        """Adapters with enough fresh records, whose oldest fresh record waited too long, or
        due a first version."""
        now = time.time() if now is None else now
        ready = []
        for adapter, state in self.states.items():
            data = state.data
            oldest = data.oldest_fresh_at()
            if (
                len(data.fresh) >= self.cfg.min_records
                or (oldest is not None and now - oldest >= self.cfg.max_record_wait_s)
                or self._first_version_due(adapter)
            ):
                ready.append(adapter)
        return ready

    def _first_version_due(self, adapter: str) -> bool:
        """Only before an adapter's first round: one refused then waits like the others."""
        state = self.states[adapter]
        due = first_version_due(state.version, state.data, self.cfg.min_holdout_records)
        return due and not state.started

    def _first_version_waits(self, training: str) -> bool:
        """Whether records read while `training` (which has a version) trains make another
        adapter due its first version (the round yields), reading only while Redis answers."""
        if self.states[training].version is None:
            return False
        if self.reader.connected:
            self.ingest()
        return any(self._first_version_due(a) for a in self.adapters if a != training)

    def train_round(self, adapter: str) -> RoundReport:
        """`steps_per_round` steps of `adapter`, acknowledging what they used, then the judge;
        a round that yields to a first version (`_first_version_waits`) ends unjudged."""
        state, cfg = self.states[adapter], self.cfg
        data = state.data
        report = RoundReport(adapter=adapter)
        if not state.started:  # an adapter with no version starts from the best
            state.started = True
            self.publisher.start_from_best(adapter, [e.record for e in data.holdout])
        started, yielded = time.perf_counter(), False
        for _ in range(cfg.steps_per_round):
            if self._stop.is_set():
                break  # stopping: judge what was trained so far, then return
            if yielded := self._first_version_waits(adapter):
                break  # its candidate is judged after its next round
            batch, fresh = data.next_batch(cfg.batch_records, self.rng)
            if not batch:
                break
            try:
                step = self.trainer.train_step(adapter, [e.record for e in batch], cfg.positions)
            except BaseException:
                data.requeue(fresh)
                raise
            data.trained(fresh)
            if self.on_trained is not None:
                self.on_trained(adapter, [e.entry_id for e in fresh])
            if self.on_trained_records is not None:
                self.on_trained_records(adapter, [e.record for e in fresh])
            state.unpublished.extend(e.arrived_at for e in fresh)
            self.reader.ack(self.acks.used(e.entry_id for e in fresh))
            report.add_step(step, len(fresh))
            self.loop_at = time.time()
            self.judging = held_for_judging(self.acks, [s.data for s in self.states.values()])
        report.train_s = time.perf_counter() - started
        self.stats.add_round(report)
        if yielded:
            report.outcome = "yielded"
        else:
            self.judge_and_publish(adapter, report)
        self._emit(report)
        return report

    def judge_and_publish(self, adapter: str, report: RoundReport | None = None) -> RoundReport:
        """Estimates candidate and current on the held-out window; publishes if better.

        Returns:
            `report` (a new one if None) with the verdict and outcome filled in.
        """
        report = report or RoundReport(adapter=adapter)
        holdout = self.states[adapter].data.holdout
        if len(holdout) < self.cfg.min_holdout_records:
            report.outcome = "waiting"
            return report
        by_domain = {d: [e.record for e in ex] for d, ex in holdout.by_domain().items()}
        verdict = judge_domains(
            {d: self.trainer.estimate(adapter, "candidate", r) for d, r in by_domain.items()},
            {d: self.trainer.estimate(adapter, "current", r) for d, r in by_domain.items()},
            margin=self.cfg.publish_margin,
            max_regression=self.cfg.max_domain_regression,
            domain_min_positions=MIN_DOMAIN_POSITIONS,
        )
        report.verdict = verdict
        if not verdict.enough_data:
            report.outcome = "waiting"
            return report
        if not verdict.publish:
            report.outcome = "refused"
            self.stats.refused += 1
            return report
        try:
            manifest = self.publisher.publish(adapter, verdict.candidate.lower)
        except StoreUnavailable as exc:
            # Redis is down or restarting: keep training; the next round judges and publishes
            # again (a version this attempt stored but did not make current stays a gap).
            _log.warning("%s: adapter store unreachable (%s); publishing later", adapter, exc)
            report.outcome = "unavailable"
            self.stats.store_errors += 1
            return report
        if manifest is None:
            report.outcome = "conflict"
            self.stats.conflicts += 1
            return report
        now = time.time()
        report.outcome, report.version = "published", manifest.version
        arrived = self.states[adapter].published()
        report.record_to_version_s = [now - t for t in arrived if t > 0]
        self.stats.published += 1
        self.stats.latencies.extend(report.record_to_version_s)
        return report

    def _emit(self, report: RoundReport) -> None:
        """Logs the round's progress line and sends its metrics to the tracker."""
        reader = self.reader.metrics()
        _log.info("%s | %s | lag %s", report.describe(), self.stats.describe(), reader.lag)
        metrics = {**report.metrics(), **self.stats.metrics(), **self.routing.last_metrics}
        for key in ("lag", "pending", "stream_length", "dead_letters"):
            value = getattr(reader, key)
            if value is not None:
                metrics[f"reader/{key}"] = float(value)
        self.tracker.log(metrics, step=self.stats.rounds)

    def run_once(self, block_ms: int = 1000) -> RoundReport | None:
        """Reads what is there (waiting up to `block_ms` when no adapter is ready), then runs
        one round of a ready adapter, if any: one due its first version before the others (it
        serves its domain with the base draft until then), the largest `expected_gain` first."""
        self.ingest(block_ms=0 if self.ready() else block_ms)
        self.routing.maybe_fit()
        ready = self.ready()
        if not ready:
            return None
        return self.train_round(max(ready, key=self.priority))

    def priority(self, adapter: str) -> tuple[bool, float]:
        """Which ready adapter's round goes first: one due its first version (it serves its
        domain with the base draft until then), then the largest `expected_gain`."""
        return self._first_version_due(adapter), expected_gain(self.states[adapter].data.fresh)

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        max_rounds: int | None = None,
        exit_when_idle_s: float | None = None,
    ) -> int:
        """Runs rounds until `stop` is set, `max_rounds` ran, or (with `exit_when_idle_s`) no
        record arrived and no round ran for that long, on `trainer.torch_threads` threads.

        Returns:
            The number of rounds run.
        """
        with threads_applied("trainer", self.cfg.torch_threads) as threads:  # osd.threads
            _log.info(threads.describe())
            return self._run_rounds(stop, max_rounds, exit_when_idle_s)

    def _run_rounds(
        self, stop: threading.Event | None, max_rounds: int | None, exit_when_idle_s: float | None
    ) -> int:
        stop = self._stop = stop or threading.Event()
        rounds, idle_since = 0, time.monotonic()
        if not self.heartbeat.started:
            self.heartbeat.start()  # replicas' /health sees the trainer consume
        while not stop.is_set() and (max_rounds is None or rounds < max_rounds):
            self.loop_at = time.time()
            self.judging = held_for_judging(self.acks, [s.data for s in self.states.values()])
            before = self.stats.read + self.stats.claimed
            report = self.run_once(block_ms=200 if exit_when_idle_s is not None else 1000)
            rounds += report is not None
            if report is not None or self.stats.read + self.stats.claimed != before:
                idle_since = time.monotonic()
            elif (
                exit_when_idle_s is not None
                and time.monotonic() - idle_since > exit_when_idle_s
                and not any(s.data.fresh for s in self.states.values())
            ):
                break
        return rounds

    def close(self) -> None:
        """Stops the heartbeat; sends leftover acknowledgements and closes the reader, store
        and tracker."""
        self.heartbeat.close()
        self.reader.close()
        self.routing.close()
        close_store = getattr(self.store, "close", None)
        if callable(close_store):
            close_store()
        self.tracker.close()
