"""Faults under the trainer: Redis SIGKILLed and restarted while it trains, and the trainer
SIGKILLed in the middle of publishing, for both adapter stores.

docs/reliability.md, rows "Redis SIGKILLed while the trainer trains" and "publisher SIGKILLed".
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from osd.adapters import open_adapter_store
from osd.adapters.codec import AdapterStore
from osd.adapters.lora import base_model_hash
from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis, connect
from osd.buffer.writer import LogWriter
from osd.config import ModelConfig
from tests.trainer.conftest import generate_records, headroom_draft, make_config, push
from trainer.draft_trainer import DraftTrainer
from trainer.publisher import Publisher
from trainer.wiring import wire_trainer
from trainer.worker import TrainerWorker

from .conftest import STREAM, wait_for

HOLDOUT_FRACTION = 0.25


@pytest.fixture(scope="module")
def logged_records() -> list[Record]:
    """Records of real speculative generations (the trainer tests' toy pair)."""
    return generate_records(48, seed=7, prefix="fault")


def relabelled(records: list[Record], num: int, tag: str) -> list[Record]:
    """`num` records cycling through `records`, each with a request id of its own."""
    cycle = itertools.cycle(records)
    return [dataclasses.replace(next(cycle), request_id=f"{tag}-{i}") for i in range(num)]


def stream_entries(url: str) -> dict[str, str]:
    """entry id -> request id of every record in the log stream."""
    client = connect(url)
    try:
        return {i.decode(): Record.unpack(f[b"r"]).request_id for i, f in client.xrange(STREAM)}
    finally:
        client.close()


def group_state(url: str, group: str) -> tuple[int, int] | None:
    """(pending, lag) of the trainer's consumer group; None while Redis cannot answer."""
    client = connect(url)
    try:
        info = next(g for g in client.xinfo_groups(STREAM) if g["name"] in (group, group.encode()))
        return int(info["pending"]), int(info["lag"])
    except Exception:  # noqa: BLE001 - restarting, loading the AOF, group not there yet
        return None
    finally:
        client.close()


class Feeder:
    """A replica's log writer fed `rate` records per second from a thread, as traffic would."""

    def __init__(self, url: str, rate: float) -> None:
        self.writer = LogWriter(url, STREAM, backoff_max_s=0.5, max_attempts=3)
        self.rate = rate
        self._pending: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def feed(self, records: list[Record]) -> None:
        with self._lock:
            self._pending.extend(records)

    def _run(self) -> None:
        while not self._stop.wait(1.0 / self.rate):
            with self._lock:
                record = self._pending.pop(0) if self._pending else None
            if record is not None:
                self.writer.log(record)

    def drained(self) -> bool:
        with self._lock:
            return not self._pending

    def __enter__(self) -> Feeder:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class WorkerThread:
    """`TrainerWorker.run` on a thread; counts how often each stream entry is trained on."""

    def __init__(self, worker: TrainerWorker) -> None:
        self.worker = worker
        self.trained: Counter[str] = Counter()
        self.error: BaseException | None = None
        worker.on_trained = lambda _adapter, ids: self.trained.update(ids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run(self._stop)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_for(self, predicate: Callable[[], object], timeout_s: float) -> float:
        """`wait_for`, failing at once with the worker's error if the worker thread died."""

        def done() -> bool:
            if not self.alive:
                pytest.fail(f"the trainer died: {self.error!r}; {self.worker.stats.describe()}")
            return bool(predicate())

        return wait_for(done, timeout_s)

    def __enter__(self) -> WorkerThread:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.worker.close()


def check_loads(store: AdapterStore, worker: TrainerWorker, version: int) -> None:
    """Loads `version` of general with every check a replica makes (sha256, base, shapes)."""
    store.load(
        "general",
        version,
        expected_base_model_hash=worker.publisher.base_hash,
        expected_shapes=worker.trainer.shapes("general"),
    )


def test_redis_killed_and_restarted_while_training_loses_no_version_and_trains_each_record_once(
    redis_server: LocalRedis, tmp_path: Path, logged_records: list[Record]
) -> None:
    url = redis_server.url
    config = make_config(
        tmp_path,
        STREAM,
        "adapters.store=redis",
        batch_records=8,
        steps_per_round=10,
        min_records=8,
        holdout_fraction=HOLDOUT_FRACTION,
        publish_margin=0.0,
        claim_idle_ms=1000,  # claims run every 0.5 s, also right after the restart
    )
    store = open_adapter_store(url)
    worker = wire_trainer(config, url, draft=headroom_draft(), base_model_id="toy")
    with Feeder(url, rate=40) as feeder, WorkerThread(worker) as trainer:
        feeder.feed(relabelled(logged_records, 96, "before"))
        trainer.wait_for(lambda: store.current("general") is not None, 60)
        trainer.wait_for(lambda: sum(trainer.trained.values()) >= 40, 60)
        versions_before = store.list_versions("general")
        pointer_before = store.current("general")
        # A burst, then the kill while the worker holds records it read but did not train on.
        push(url, STREAM, relabelled(logged_records, 64, "burst"))
        feeder.feed(relabelled(logged_records, 32, "down"))
        trainer.wait_for(lambda: len(worker.data["general"].fresh) >= 24, 60)
        redis_server.kill()
        killed_at = time.perf_counter()
        trained_at_kill = sum(trainer.trained.values())
        fresh_at_kill = len(worker.data["general"].fresh)
        time.sleep(2.5)
        alive_while_down = trainer.alive
        trained_while_down = sum(trainer.trained.values()) - trained_at_kill
        redis_server.restart()
        down_s = time.perf_counter() - killed_at

        store = open_adapter_store(url)  # the old pool's connections died with the server
        pointer_after_restart = store.current("general")
        versions_after_restart = store.list_versions("general")
        published_before_restart = worker.stats.published
        feeder.feed(relabelled(logged_records, 96, "after"))
        wait_for(feeder.drained, 60)
        assert feeder.writer.flush(10)
        # Everything read, and all trained on but the judge's window (pending until trained).
        trainer.wait_for(
            lambda: (
                group_state(url, config.trainer.group) == (len(worker.data["general"].holdout), 0)
            ),
            90,
        )
        trainer.wait_for(lambda: worker.stats.published > published_before_restart, 60)
        error = trainer.error
        redelivered = worker.reader.metrics().redelivered
    written = feeder.writer.close()
    final_pointer = store.current("general")
    entries = stream_entries(url)

    held_out = {e.entry_id for e in worker.data["general"].holdout}  # judging, not yet trained
    trained_twice = {e: n for e, n in trainer.trained.items() if n > 1}
    print(
        f"\n[trainer-redis-kill] down {down_s:.2f} s; trainer alive while down "
        f"{alive_while_down}; it held {fresh_at_kill} untrained records and trained "
        f"{trained_while_down} while down; writer {written}; "
        f"{len(entries)} records in the stream, {len(held_out)} held out, "
        f"{len(trainer.trained)} trained, {len(trained_twice)} trained twice ({redelivered} "
        f"redeliveries refused by the reader); versions before "
        f"the kill {versions_before} (pointer v{pointer_before}), after the restart "
        f"{versions_after_restart} (pointer v{pointer_after_restart}), final pointer "
        f"v{final_pointer}; stats {worker.stats.describe()}"
    )
    assert error is None, repr(error)
    assert alive_while_down
    # No published version was lost: the pointer and every version survived the restart (AOF),
    # and each still loads with a replica's checks.
    assert pointer_after_restart is not None and pointer_after_restart >= pointer_before
    assert set(versions_before) <= set(versions_after_restart)
    for version in versions_before:
        check_loads(store, worker, version)
    # Every record in the stream was trained on exactly once, or is in the judge's window (to be
    # trained once newer records push it out); none was lost.
    assert trained_twice == {}
    assert set(trainer.trained) == set(entries) - held_out
    # The trainer kept publishing after the restart, on top of what it had published before.
    assert final_pointer is not None and final_pointer > pointer_after_restart
    check_loads(store, worker, final_pointer)
    chain = [final_pointer]
    while (parent := store.manifest("general", chain[-1]).parent_version) is not None:
        chain.append(parent)
    assert pointer_before in chain


# The trainer SIGKILLed while it publishes.

PHASES = ("training", "encoding", "allocating", "writing", "moving pointer", "published")
HELD = -2  # `hold` once the child stopped where it was told to (-1: no hold)


def publish_until_killed(
    location: str, trainer: DraftTrainer, phase: Any, hold: Any, ready: Any
) -> None:
    """A trainer process that does nothing but publish new candidates, as fast as it can.

    Runs in a forked child (it inherits `trainer`) until the test SIGKILLs it. It resumes as a
    restarted trainer does (`Publisher.restore`), then publishes random candidates; `phase`
    (shared memory) says which step of `VersionedStore.publish` it is in, for the test's tally.
    When `hold` names a step, the child stops for good right after that step's work is done
    (a number allocated and nothing written; a version written and the pointer not moved), so
    the kill lands there whatever the machine's speed.
    """
    store = open_adapter_store(location)  # its own connection, not the parent's
    steps = {"_allocate_version": "allocating", "_write_version": "writing"}
    steps["_compare_and_set"] = "moving pointer"
    for method, step in steps.items():
        setattr(store, method, _staged(getattr(store, method), phase, hold, step))
    publisher = Publisher(store, trainer)
    publisher.restore("general")
    gen = torch.Generator().manual_seed(os.getpid())
    shapes = trainer.shapes("general")
    ready.set()
    while True:
        phase.value = PHASES.index("training")
        weights = {k: 0.05 * torch.randn(shape, generator=gen) for k, shape in shapes.items()}
        trainer.set_weights("general", weights, ["candidate"])
        phase.value = PHASES.index("encoding")
        publisher.publish("general", 0.5)
        phase.value = PHASES.index("published")


def _staged(method: Callable[..., Any], phase: Any, hold: Any, step: str) -> Callable[..., Any]:
    """`method`, setting `phase` to `step` while it runs (and to "published" after the pointer
    moved: the rest is bookkeeping in the trainer's memory); it never returns if `hold` names
    `step` (the test kills it there)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        phase.value = PHASES.index(step)
        result = method(*args, **kwargs)
        if hold.value == PHASES.index(step):
            hold.value = HELD
            time.sleep(3600)
        if step == "moving pointer":
            phase.value = PHASES.index("published")
        return result

    return wrapped


class PointerReader:
    """A replica's view, polled from a thread: loads whatever version the pointer names, with
    every check a replica makes, and counts what it saw."""

    def __init__(self, location: str, base_hash: str, shapes: dict[str, tuple[int, ...]]) -> None:
        self.store = open_adapter_store(location)
        self.base_hash, self.shapes = base_hash, shapes
        self.loads = 0
        self.seen: set[int] = set()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            version = self.store.current("general")
            if version is None:
                continue
            try:
                self.store.load(
                    "general",
                    version,
                    expected_base_model_hash=self.base_hash,
                    expected_shapes=self.shapes,
                )
            except Exception as exc:  # noqa: BLE001 - every failure is asserted on
                self.failures.append(f"v{version}: {exc!r}")
            self.loads += 1
            self.seen.add(version)

    def __enter__(self) -> PointerReader:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def stored_versions(location: str) -> tuple[set[int], list[str], int]:
    """(versions with any bytes stored, each checked to have both weights and manifest;
    leftover temp dirs; the last version number handed out), read from the raw store."""
    if location.startswith("redis://"):
        client = connect(location)
        keys = {k.decode() for k in client.keys("osd:adapter:general:v[0-9]*:*")}
        allocated = int(client.get("osd:adapter:general:last_version"))
        client.close()
        numbers = {int(k.split(":")[3][1:]) for k in keys}
        for n in numbers:
            assert {f"osd:adapter:general:v{n}:{part}" for part in ("weights", "manifest")} <= keys
        return numbers, [], allocated
    root = Path(location) / "general"
    numbers = set()
    for path in root.glob("v*"):
        assert {p.name for p in path.iterdir()} == {"adapter.safetensors", "manifest.json"}
        numbers.add(int(path.name[1:]))
    leftovers = [p.name for p in root.glob(".tmp-*")]
    return numbers, leftovers, int((root / "LAST_VERSION").read_text())


@pytest.fixture(scope="module")
def publishing_trainer() -> DraftTrainer:
    """The trainer's draft with its LoRA slots (the replicas' layout); nothing is trained."""
    return DraftTrainer(headroom_draft(), ModelConfig(), ["general"], base_model_id="toy")


@pytest.mark.parametrize("backend", ["redis", "directory"])
def test_trainer_sigkilled_while_publishing_never_leaves_the_pointer_on_a_broken_version(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, publishing_trainer: DraftTrainer
) -> None:
    trainer, num_kills = publishing_trainer, 40
    if backend == "redis":
        location = request.getfixturevalue("redis_server").url
    else:
        location = str(tmp_path / "adapters")
    store = open_adapter_store(location)
    base_hash, shapes = base_model_hash(trainer.model), trainer.shapes("general")
    ctx = multiprocessing.get_context("fork")
    phase, hold = ctx.Value("i", 0, lock=False), ctx.Value("i", -1, lock=False)
    rng = random.Random(0)
    killed_in: Counter[str] = Counter()
    # Most kills land at a random moment; every fourth is held inside publishing (alternately
    # after allocating and after writing), so both partial states are met on any machine.
    holds = ("allocating", "writing")
    with PointerReader(location, base_hash, shapes) as reader:
        for i in range(num_kills):
            hold.value = PHASES.index(holds[i // 4 % 2]) if i % 4 == 3 else -1
            ready = ctx.Event()
            args = (location, trainer, phase, hold, ready)
            child = ctx.Process(target=publish_until_killed, args=args)
            child.start()
            assert ready.wait(30), "the publisher did not start"
            if hold.value == -1:
                time.sleep(rng.uniform(0.0, 0.05))
            else:
                deadline = time.monotonic() + 30
                while hold.value != HELD and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert hold.value == HELD, "the publisher never reached its hold"
            killed_in[PHASES[phase.value]] += 1
            os.kill(child.pid, signal.SIGKILL)
            child.join(timeout=10)
            assert child.exitcode == -signal.SIGKILL
        # A trainer started after all this resumes and publishes on top of the pointer.
        publisher = Publisher(store, trainer)
        resumed_from = publisher.restore("general")
        final = publisher.publish("general", 0.5)
    pointer, versions = store.current("general"), store.list_versions("general")
    for version in versions:
        store.load("general", version, expected_base_model_hash=base_hash, expected_shapes=shapes)
    stored, leftovers, allocated = stored_versions(location)
    print(
        f"\n[publisher-kill {backend}] {num_kills} SIGKILLs, landed while {dict(killed_in)}; "
        f"{len(versions)} complete versions of {allocated} numbers allocated, "
        f"{len(leftovers)} partial temp dirs left; the concurrent reader loaded {reader.loads} "
        f"pointed versions ({len(reader.seen)} distinct), {len(reader.failures)} failed; "
        f"pointer v{pointer}, resumed from v{resumed_from}"
    )
    assert reader.failures == []
    assert reader.loads > num_kills and len(reader.seen) > 1
    # Kills landed inside publishing, in more than one of its steps.
    inside = {p for p in killed_in if p in ("encoding", "allocating", "writing", "moving pointer")}
    assert len(inside) >= 2, killed_in
    # The pointer names a complete version; every listed version is complete and loads; partial
    # writes (numbers allocated but never completed, temp dirs) are never listed or pointed to.
    assert pointer == final.version and final.parent_version == resumed_from
    assert resumed_from in versions
    # What is stored under a version number is complete (weights and manifest) and listed; a
    # temp dir holds a number that never became a version.
    assert stored == set(versions) <= set(range(1, allocated + 1))
    assert not {int(name.split("-")[1][1:]) for name in leftovers} & stored


def test_trainer_started_while_redis_is_down_claims_the_pending_entries_once_it_is_back(
    redis_server: LocalRedis, tmp_path: Path, logged_records: list[Record]
) -> None:
    url = redis_server.url
    # claim_idle_ms of an hour: without the retried start-up claim these entries would wait.
    config = make_config(tmp_path, STREAM, min_records=10_000, claim_idle_ms=3_600_000)
    push(url, STREAM, relabelled(logged_records, 24, "pending"))
    crashed = wire_trainer(config, url, draft=headroom_draft(), consumer="crashed")
    read = crashed.ingest()
    assert read == 24  # read, never acknowledged (the held-out ones were): then the crash
    client = connect(url)
    pending = int(client.xpending(STREAM, config.trainer.group)["pending"])
    client.close()
    assert pending > 0

    redis_server.kill()
    worker = wire_trainer(config, url, draft=headroom_draft(), consumer="restarted")
    assert worker.stats.claimed == 0  # Redis did not answer the start-up claim
    redis_server.restart()
    claimed = 0
    deadline = time.monotonic() + 60
    while claimed < pending and time.monotonic() < deadline:  # the reader's backoff passes
        worker.ingest()
        claimed = worker.stats.claimed
    worker.close()
    print(f"\n[trainer-start-redis-down] {pending} pending, {claimed} claimed after the restart")
    assert claimed == pending
