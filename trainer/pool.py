"""A pool of trainer workers sharing one log stream (`trainer.workers` > 1).

Each worker process is a `PoolWorker`. Through Redis leases (`trainer.leases`) the pool decides

- which worker **dispatches** (`DISPATCH`): it reads the log stream as a consumer of
  `trainer.group`, routes each record as one trainer would (labels, content routing's scores and
  topics, `trainer.examples.adapters_for`), fits the routing model, and forwards each record to
  the stream of every adapter that learns from it, ``<stream>:train:<adapter>``, with its assigned
  domain written into it. Forwarding and acknowledging the log entry are one Lua script that first
  checks the dispatcher still holds its lease: a record is forwarded exactly once, or stays
  pending for the next dispatcher;
- which worker **owns each adapter**: the owner reads that adapter's stream as a consumer of
  `trainer.group` with a `TrainerWorker` of that adapter alone (windows, rounds, judge,
  compare-and-set publishing, as with one trainer), acknowledging (and deleting) an entry once it
  trained on it. An adapter whose owner stops renewing its lease goes to another worker after
  `trainer.lease_s`, which resumes from the store's pointer and claims every entry the adapter's
  stream holds pending (`TrainerWorker.resume`).

Each worker renews its leases on a thread; the main loop takes free adapters up to its share
(an even split, `LeaseTable.share`), gives up those beyond it, follows the versions of adapters
other workers own (content routing scores records under every adapter's current version), and
runs one round at a time of the owned adapter with the most to gain. Its status (adapters,
each adapter stream's lag and pending entries, whether it dispatches) is written to
``<stream>:trainer:<group>:workers`` for replicas' `/health` and `osd demo`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import redis

from osd.adapters import adapter_store_location, open_adapter_store
from osd.buffer.loop_status import pool_status_key
from osd.buffer.reader import LogReader
from osd.buffer.record import Record
from osd.buffer.redis_server import connect
from osd.closing import Closeable
from osd.config import OSDConfig
from osd.threads import threads_applied
from osd.versions.errors import StoreError
from trainer.adapter_state import adapter_states
from trainer.data_parallel import DataParallel
from trainer.draft_trainer import DraftTrainer, build_draft_trainer
from trainer.examples import Example, adapters_for, entry_time
from trainer.heartbeat import Heartbeat
from trainer.leases import DISPATCH, LeaseTable, lease_key
from trainer.publisher import Publisher
from trainer.replay import held_for_judging
from trainer.tracking import NullTracker, Tracker
from trainer.wiring import configured_publisher, configured_routing
from trainer.worker import NoRouting, RoundReport, TrainerWorker, usable_record
from trainer.worker_stats import latency_summary

__all__ = ["Dispatcher", "PoolWorker", "adapter_stream"]

_log = logging.getLogger(__name__)
_MAX_READ = 256
_MAX_CLAIM = 100_000
AUDIT_ENV = "OSD_TRAINER_AUDIT"  # a directory: each worker appends the records it trained
MEMBER_ENV = "OSD_TRAINER_POOL_MEMBER"  # `osd train --workers`: the member's index

# Forward log entries to adapter streams and acknowledge them, only while holding the dispatch
# lease. ARGV: worker id, group, entry count, then per entry: its id ("" for a copy with no log
# entry to acknowledge), the packed record, the number of targets, the targets' KEYS indices.
# An entry acknowledged already is not forwarded again: a retry of a call whose reply was lost
# (it ran, the connection dropped) forwards nothing twice.
_FORWARD = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local n, i, sent = tonumber(ARGV[3]), 4, 0
for _ = 1, n do
  local src, payload, k = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  i = i + 3
  local fresh = src == '' or redis.call('XACK', KEYS[2], ARGV[2], src) == 1
  for _ = 1, k do
    if fresh then
      redis.call('XADD', KEYS[2 + tonumber(ARGV[i])], '*', 'r', payload, 's', src)
      sent = sent + 1
    end
    i = i + 1
  end
end
return sent
"""


def adapter_stream(stream: str, adapter: str) -> str:
    """The stream a pool forwards `adapter`'s records to."""
    return f"{stream}:train:{adapter}"


class Dispatcher(Closeable):
    """Reads the log as one consumer of `trainer.group` and forwards each record to its
    adapters' streams (while this worker holds `DISPATCH`).

    Args:
        config: the deployment's config.
        url: the log's Redis.
        worker_id: this worker (its consumer name).
        trainer: the draft trainer; content routing scores records under its current slots.
        versions: adapter -> its current version, kept by the pool for every adapter.
    """

    def __init__(
        self,
        config: OSDConfig,
        url: str,
        worker_id: str,
        trainer: DraftTrainer,
        versions: Mapping[str, int | None],
    ) -> None:
        cfg, stream = config.trainer, config.log.stream
        self.cfg, self.worker_id = cfg, worker_id
        self.adapters = list(config.model.adapters)
        self.vocab_size = int(trainer.model.get_output_embeddings().weight.shape[0])
        self.reader = LogReader(url, stream, cfg.group, worker_id)
        self.routing = configured_routing(config, url, trainer, versions)
        self._client = connect(url)
        self._forward = self._client.register_script(_FORWARD)
        self._keys = [
            lease_key(stream, cfg.group, DISPATCH),
            stream,
            *(adapter_stream(stream, a) for a in self.adapters),
        ]
        # Forwarding waits while an adapter's stream holds this many records its owner has not
        # read (it is behind or gone): the backlog stays in the log, whose budget bounds it.
        self.backlog_limit = max(1024, 4 * cfg.steps_per_round * cfg.batch_records)
        self.counts: Counter[str] = Counter()
        self.lost = False  # the lease was gone when forwarding: stop dispatching
        self._unsent: list[tuple[str, bytes, list[int]]] = []
        self._last_claim = time.monotonic()

    def start(self) -> int:
        """Claims every entry the group holds pending (a previous dispatcher's) and forwards
        them; returns how many."""
        entries = self.reader.claim_stale(0, _MAX_CLAIM)
        self.counts["claimed"] += len(entries)
        return self._route(entries)

    def step(self, block_ms: int = 0) -> int:
        """Forwards what waits (records read before, then stale and new ones); returns how many
        log entries it handled."""
        if self._unsent and not self._send():
            return 0
        handled = 0
        idle_ms = self.cfg.claim_idle_ms
        if idle_ms and time.monotonic() - self._last_claim > idle_ms / 2e3:
            self._last_claim = time.monotonic()
            entries = self.reader.claim_stale(idle_ms, _MAX_READ)
            self.counts["claimed"] += len(entries)
            handled += self._route(entries)
        if self._room():
            entries = self.reader.read(count=_MAX_READ, block_ms=block_ms)
            self.counts["read"] += len(entries)
            handled += self._route(entries)
        self.routing.maybe_fit()
        return handled

    def _room(self) -> bool:
        """Whether every adapter's stream has fewer than `backlog_limit` records its owner has
        not read yet (entries minus those pending: acknowledged ones are deleted, and records
        held in judge windows stay pending, so they do not count)."""
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in self._keys[2:]:
                pipe.xlen(key)
                pipe.xpending(key, self.cfg.group)
            replies = pipe.execute()
        except redis.ResponseError:  # no group yet: nobody has read anything
            return True
        except redis.RedisError:
            return False
        unread = [
            length - int(pending.get("pending", 0) if isinstance(pending, dict) else 0)
            for length, pending in zip(replies[::2], replies[1::2], strict=True)
        ]
        return max(unread, default=0) < self.backlog_limit

    def _route(self, entries: list[tuple[str, Record]]) -> int:
        if not entries:
            return 0
        usable = []
        for entry_id, record in entries:
            if usable_record(record, self.vocab_size):
                usable.append(Example(entry_id, record, entry_time(entry_id)))
            else:
                self.counts["skipped"] += 1
                self._unsent.append((entry_id, b"", []))
        assigned, taken = self.routing.observe(usable)
        for example in usable:
            domain = assigned.get(example.entry_id) or None
            self._unsent.append((example.entry_id, *self._copy(example.record, domain)))
        for example, domain in taken:  # a new topic takes earlier records: one more copy each
            self._unsent.append(("", *self._copy(example.record, domain, only=domain)))
        self._send()
        return len(entries)

    def _copy(
        self, record: Record, domain: str | None, only: str | None = None
    ) -> tuple[bytes, list[int]]:
        """The packed record (its assigned domain written in) and its target adapters."""
        if domain:
            record = dataclasses.replace(record, domain=domain)
        targets = [only] if only else adapters_for(record, self.adapters, domain)
        return record.pack(), [self.adapters.index(a) for a in targets]

    def _send(self) -> bool:
        """Sends what waits, `_MAX_READ` entries a call; False when Redis did not answer (the
        rest waits) or the lease is gone (nothing more is sent: the entries stay pending)."""
        while self._unsent:
            chunk = self._unsent[:_MAX_READ]
            args: list[Any] = [self.worker_id, self.cfg.group, len(chunk)]
            for entry_id, payload, targets in chunk:
                args += [entry_id, payload, len(targets), *(t + 1 for t in targets)]
            try:
                sent = int(self._forward(keys=self._keys, args=args))
            except redis.RedisError as exc:
                # A retry skips entries acknowledged already; a copy with no log entry (a topic
                # taking earlier records) cannot tell, so it is dropped rather than doubled.
                self._unsent = [u for u in self._unsent if u[0]]
                _log.warning(
                    "dispatch: Redis did not take %d records (%s); retrying", len(chunk), exc
                )
                return False
            if sent < 0:
                _log.warning("dispatch: the lease is gone; %d records stay pending", len(chunk))
                self.lost = True
                self._unsent.clear()
                return False
            self.counts["forwarded"] += sent
            self.counts["dispatched"] += sum(1 for e, _, _ in chunk if e)
            del self._unsent[: len(chunk)]
        return True

    def close(self) -> None:
        self.reader.close()
        self.routing.close()
        self._client.close()


class _StopWhen(threading.Event):
    """A member's stop: set itself when its adapter's lease is lost, or when `also` says the
    whole worker stops (SIGTERM: the round ends after its current step, as one trainer's)."""

    def __init__(self, also: Callable[[], bool]) -> None:
        super().__init__()
        self.also = also

    def is_set(self) -> bool:
        return super().is_set() or self.also()


class _Borrowed:
    """The pool's tracker lent to its members: one step counter for all of them (each member
    counts its own rounds, and W&B drops a step lower than one it saw), and a member's `close`
    leaves it open."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.step = 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.step += 1
        self.tracker.log(metrics, self.step)

    def close(self) -> None:
        pass


class PoolWorker(Closeable):
    """One worker of a pool (module docstring).

    Args:
        config: the deployment's config (`trainer.lease_s`, `trainer.group`, ...).
        url: the log's Redis (the adapter store's too, for the redis store).
        draft, base_model_id: as in `trainer.wiring.wire_trainer`.
        tracker: where round metrics go.
        worker_id: this worker's unique name (default `trainer.consumer` or host-pid).
        data_parallel: the group this worker leads when it trains on several devices.
    """

    def __init__(
        self,
        config: OSDConfig,
        url: str,
        *,
        draft: Any = None,
        base_model_id: str | None = None,
        tracker: Tracker | None = None,
        worker_id: str | None = None,
        data_parallel: DataParallel | None = None,
    ) -> None:
        cfg = self.cfg = config.trainer
        self.config, self.url = config, url
        self.stream, self.group = config.log.stream, cfg.group
        self.adapters = list(config.model.adapters)
        member = os.environ.get(MEMBER_ENV, "")  # `osd train --workers`: this member's index
        named = f"{cfg.consumer}-{member}" if cfg.consumer and member else cfg.consumer
        self.worker_id = worker_id or named or f"{socket.gethostname()}-{os.getpid()}"
        self.trainer = build_draft_trainer(
            config, self.adapters, draft, base_model_id, data_parallel
        )
        self.states = adapter_states(cfg, self.adapters)  # every adapter's; members own theirs
        self.location = adapter_store_location(config, url)
        self.store = open_adapter_store(self.location)
        self.follower = self._publisher(self.store)  # loads the versions others publish
        self.tracker = tracker or NullTracker()
        self._lent = _Borrowed(self.tracker)  # the members' rounds, in one sequence of steps
        self.leases = LeaseTable(
            url, self.stream, self.group, self.worker_id, self.adapters, lease_s=cfg.lease_s
        )
        self.leases.on_lost = self._on_lost
        self.members: dict[str, TrainerWorker] = {}
        self._member_stop: dict[str, threading.Event] = {}
        # Members whose lease was lost (adapter -> member, when): kept until taken again.
        self._suspended: dict[str, tuple[TrainerWorker, float]] = {}
        self.dispatcher: Dispatcher | None = None
        self.totals: Counter[str] = Counter()  # stats of members already given up
        self._latencies: list[float] = []  # their record-to-version seconds
        self.loop_at = time.time()
        self._beat: tuple[float, float, int, int] = (self.loop_at, 0.0, 0, 0)
        self._status = connect(url)
        self._audit = _open_audit(self.worker_id)
        self.heartbeat = Heartbeat(
            url, self.stream, self.group, self._progress, active=lambda: self.dispatcher is not None
        )
        self._stop = threading.Event()

    def _publisher(self, store: Any) -> Publisher:
        return configured_publisher(self.config, store, self.trainer, self.states)

    # Membership.

    def _member(self, adapter: str) -> TrainerWorker:
        """A worker for `adapter` alone, resumed: the store's version loaded, every entry its
        stream holds pending claimed."""
        store = open_adapter_store(self.location)
        stream = adapter_stream(self.stream, adapter)
        member = TrainerWorker(
            self.config,
            trainer=self.trainer,
            store=store,
            publisher=self._publisher(store),
            reader=LogReader(self.url, stream, self.group, self.worker_id, delete_acked=True),
            routing=NoRouting(),
            tracker=self._lent,
            heartbeat=lambda progress: Heartbeat(self.url, stream, self.group, progress),
            owned=[adapter],
        )
        stop = self._member_stop[adapter] = _StopWhen(
            lambda: self._stop.is_set() or not self.leases.fresh()
        )
        member.stop_rounds_on(stop)
        if self._audit is not None:
            member.on_trained_records = self._audited
        member.resume()
        _log.info("%s: owns %s (%d records pending)", self.worker_id, adapter, member.stats.claimed)
        return member

    def _resumed(self, adapter: str) -> TrainerWorker:
        """A new member for `adapter`, or the one suspended when its lease was lost (Redis
        away): it still holds its records and the acknowledgements Redis did not take, so
        nothing it trained is trained again. Resumed as a new one is: the store's version,
        then the entries pending that it does not hold."""
        if adapter in self.members:  # lost and taken back before the loop saw the loss
            return self.members[adapter]
        suspended = self._suspended.pop(adapter, None)
        if suspended is None:
            return self._member(adapter)
        member = suspended[0]
        self._member_stop[adapter].clear()
        # Its candidate goes on from where it was, unless another worker published meanwhile.
        member.resume(reload=self._version_moved(adapter))
        _log.info("%s: owns %s again (kept its records)", self.worker_id, adapter)
        return member

    def _version_moved(self, adapter: str) -> bool:
        try:
            return self.store.current(adapter) != self.states[adapter].version
        except StoreError:
            return True

    def _on_lost(self, names: list[str]) -> None:
        """From the renewal thread: rounds of adapters whose lease is gone end after the step."""
        for name in names:
            event = self._member_stop.get(name)
            if event is not None:
                event.set()

    def _drop(self, adapter: str) -> None:
        member = self.members.pop(adapter, None)
        if member is not None:
            self._retire(adapter, member)

    def _retire(self, adapter: str, member: TrainerWorker) -> None:
        """Closes a member for good (its unsent acknowledgements go if Redis answers)."""
        self._member_stop.pop(adapter, None)
        self.totals.update(_numbers(member))
        self._latencies.extend(member.stats.latencies)
        member.close()
        # Its windows held records now pending for the next owner: start from nothing if this
        # worker takes the adapter again (its version is followed from the store meanwhile).
        fresh = adapter_states(self.cfg, self.adapters)[adapter]
        fresh.version = self.states[adapter].version  # what its slots still hold
        self.states[adapter] = fresh

    def _settle_suspended(self) -> None:
        """Retires the suspended members whose adapter another worker holds now, or whose lease
        stayed lost for `3 * lease_s`."""
        for adapter, (member, since) in list(self._suspended.items()):
            owner = self.leases.owner(adapter)
            if (
                owner not in (None, self.worker_id)
                or time.monotonic() - since > 3 * self.cfg.lease_s
            ):
                del self._suspended[adapter]
                self._retire(adapter, member)

    def _rebalance(self) -> None:
        self._drop_lost()
        taken, surplus = self.leases.balance()
        for adapter in surplus:
            self._drop(adapter)
            self.leases.release(adapter)
        for adapter in taken:
            self.members[adapter] = self._resumed(adapter)
        self._settle_suspended()
        if self.dispatcher is None and self.leases.acquire(DISPATCH):
            self.dispatcher = Dispatcher(
                self.config, self.url, self.worker_id, self.trainer, self.follower.versions
            )
            claimed = self.dispatcher.start()
            _log.info(
                "%s: dispatches the log (%d pending entries claimed)", self.worker_id, claimed
            )

    def _drop_lost(self) -> None:
        lost = self.leases.lost()
        if self.dispatcher is not None and (DISPATCH in lost or self.dispatcher.lost):
            self.dispatcher.close()
            self.dispatcher = None
            if DISPATCH not in lost:
                self.leases.release(DISPATCH)
        for adapter in lost - {DISPATCH}:  # suspended: no rounds until the lease is back
            member = self.members.pop(adapter, None)
            if member is not None:
                self._suspended[adapter] = (member, time.monotonic())

    def _follow(self) -> None:
        """Loads the versions other workers published of the adapters this one does not own."""
        for adapter in self.adapters:
            if adapter in self.members:
                continue
            try:
                if self.store.current(adapter) != self.states[adapter].version:
                    self.follower.restore(adapter)
            except StoreError as exc:
                _log.debug("%s: cannot follow %s (%s)", self.worker_id, adapter, exc)

    # Training.

    def _train_once(self) -> RoundReport | None:
        for member in self.members.values():
            member.ingest(block_ms=0)
        ready = [(m, a) for m in self.members.values() for a in m.ready()]
        if not ready:
            return None
        member, adapter = max(ready, key=lambda ma: ma[0].priority(ma[1]))
        return member.train_round(adapter)

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        max_rounds: int | None = None,
        exit_when_idle_s: float | None = None,
    ) -> int:
        """Takes part in the pool until `stop`, `max_rounds` rounds, or (with
        `exit_when_idle_s`) nothing read, forwarded or trained for that long.

        Returns:
            The number of rounds this worker ran.
        """
        stop = self._stop = stop or threading.Event()
        with threads_applied("trainer", self.cfg.torch_threads) as threads:
            _log.info("%s: %s", self.worker_id, threads.describe())
            if not self.heartbeat.started:  # a second `run` goes on where the first stopped
                self.leases.start()
                self.heartbeat.start()
            rounds, idle_since, next_balance = 0, time.monotonic(), 0.0
            while not stop.is_set() and (max_rounds is None or rounds < max_rounds):
                self.loop_at = time.time()
                self._beat = self._measure()
                if time.monotonic() >= next_balance:
                    next_balance = time.monotonic() + self.cfg.lease_s / 3
                    self._rebalance()
                    self._follow()
                    self._report_status()
                else:
                    self._drop_lost()
                before = self._progress_count()
                handled = self.dispatcher.step() if self.dispatcher is not None else 0
                report = self._train_once()
                rounds += report is not None
                if report is not None or handled or self._progress_count() != before:
                    idle_since = time.monotonic()
                    continue
                if (
                    exit_when_idle_s is not None
                    and time.monotonic() - idle_since > exit_when_idle_s
                    and not any(
                        s.data.fresh for m in self.members.values() for s in m.states.values()
                    )
                ):
                    break
                stop.wait(0.05)
            return rounds

    def _progress_count(self) -> int:
        return sum(m.stats.read + m.stats.claimed for m in self.members.values())

    def _progress(self) -> tuple[float, float, int, int]:
        """(loop_at, last_ack_at, rounds, judging) for the heartbeat of the log's group, as the
        main loop last computed it (the heartbeat's thread must not walk the windows)."""
        return self._beat

    def _measure(self) -> tuple[float, float, int, int]:
        members = list(self.members.values())
        readers = [m.reader for m in members]
        if self.dispatcher is not None:
            readers.append(self.dispatcher.reader)
        last_ack = max((r.last_ack_at for r in readers), default=0.0)
        rounds = sum(m.stats.rounds for m in members) + int(self.totals["rounds"])
        judging = sum(
            held_for_judging(m.acks, [s.data for s in m.states.values()]) for m in members
        )
        return self.loop_at, last_ack, rounds, judging

    def _report_status(self) -> None:
        lags: dict[str, dict[str, int | None]] = {}
        for adapter, member in self.members.items():
            metrics = member.reader.metrics()
            lags[adapter] = {"lag": metrics.lag, "pending": metrics.pending}
        status = {
            "worker": self.worker_id,
            "pid": os.getpid(),
            "adapters": list(self.members),
            "dispatching": self.dispatcher is not None,
            "streams": lags,
            "rounds": self._beat[2],
            "published": sum(m.stats.published for m in self.members.values())
            + int(self.totals["published"]),
            "at": time.time(),
        }
        try:
            self._status.hset(
                pool_status_key(self.stream, self.group), self.worker_id, json.dumps(status)
            )
        except redis.RedisError as exc:
            _log.debug("%s: status not written (%s)", self.worker_id, exc)

    def stats(self) -> dict[str, Any]:
        """Totals over the adapters this worker owned, and what it dispatched."""
        totals: Counter[str] = Counter(self.totals)
        working = [*self.members.values(), *(m for m, _ in self._suspended.values())]
        for member in working:
            totals.update(_numbers(member))
        out: dict[str, Any] = dict(totals)
        latencies = [*self._latencies, *(x for m in working for x in m.stats.latencies)]
        if latencies:
            out["record_to_version_s"] = latency_summary(latencies)
        out["dispatch"] = dict(self.dispatcher.counts) if self.dispatcher is not None else {}
        out["adapters"] = list(self.members)
        return out

    def _audited(self, adapter: str, records: list[Record]) -> None:
        assert self._audit is not None
        self._audit.write("".join(f"{adapter} {r.request_id}\n" for r in records))

    def close(self) -> None:
        """Ends its rounds, gives every adapter and the dispatch up, and leaves the pool."""
        final = self.stats()
        for adapter in list(self.members):
            self._drop(adapter)
        for adapter, (member, _) in list(self._suspended.items()):
            del self._suspended[adapter]
            self._retire(adapter, member)
        if self.dispatcher is not None:
            self.dispatcher.close()
            self.dispatcher = None
        self.leases.close()
        self.heartbeat.close()
        with contextlib.suppress(redis.RedisError):
            self._status.hdel(pool_status_key(self.stream, self.group), self.worker_id)
        self._status.close()
        close_store = getattr(self.store, "close", None)
        if callable(close_store):
            close_store()
        self.tracker.close()
        if self._audit is not None:
            self._audit.close()
        self.final_stats = final


def _numbers(member: TrainerWorker) -> dict[str, int | float]:
    """A member's totals that add up across members (counts and seconds)."""
    return {k: v for k, v in member.stats.as_dict().items() if isinstance(v, int | float)}


def _open_audit(worker_id: str) -> TextIO | None:
    """`OSD_TRAINER_AUDIT=<dir>`: one line per record trained (`<adapter> <request id>`),
    written as it is trained, for fault tests and audits (never on by default)."""
    folder = os.environ.get(AUDIT_ENV)
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return open(Path(folder) / f"{worker_id}.log", "a", buffering=1)  # noqa: SIM115
