"""A pool of trainer workers on one log (`trainer.pool`): leases share the adapters out, a dead
worker's adapters are taken over, and across SIGKILLs every record is trained once per adapter
or still held to judge on, and every adapter's versions descend from the last published one."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from osd.adapters import open_adapter_store
from osd.buffer.loop_status import read_pool_status
from osd.buffer.record import Record
from osd.buffer.redis_server import connect
from tests.trainer.conftest import push, trainer_overrides
from tests.trainer.test_restart import REPO
from trainer.examples import adapters_for
from trainer.leases import DISPATCH, LeaseTable
from trainer.pool import AUDIT_ENV, adapter_stream

ADAPTERS = ["general", "code", "sql"]


def table(
    url: str, stream: str, worker: str, lease_s: float = 10.0, group: str = "g"
) -> LeaseTable:
    return LeaseTable(url, stream, group, worker, ADAPTERS, lease_s=lease_s)


def test_leases_share_the_adapters_and_a_dead_workers_go_to_the_others(redis_url, stream):
    a = table(redis_url, stream, "a")
    a.renew()
    assert a.balance() == (ADAPTERS, [])  # alone: all of them
    b = table(redis_url, stream, "b")
    b.renew()
    assert b.balance() == ([], [])  # nothing free yet
    taken, surplus = a.balance()  # two live workers: a's share is 2
    assert taken == [] and surplus == ["sql"]
    a.release("sql")
    assert b.balance() == (["sql"], [])
    assert not a.acquire("sql")  # held by b
    assert a.acquire(DISPATCH) and not b.acquire(DISPATCH)

    # c takes one lease and dies (never renews): the lease runs out, then another worker takes it.
    b.release("sql")
    c = table(redis_url, stream, "c", lease_s=0.5)
    c.renew()
    assert c.acquire("sql")
    assert not b.acquire("sql")
    time.sleep(0.6)
    assert b.acquire("sql")
    assert c.renew() and c.lost() == {"sql"}  # c learns it lost it at its next renewal

    # Shares split evenly, the first workers by id taking the remainder: nobody is left idle.
    four = ["general", "code", "sql", "math"]
    shares = []
    for name in ("w0", "w1", "w2"):
        with LeaseTable(redis_url, stream, "g", name, four) as lease_table:
            shares.append(lease_table.share(["w0", "w1", "w2"]))
    assert shares == [2, 1, 1]

    # a leaves cleanly: its adapters and the dispatch are free at once, and b's share grows.
    c.close()
    a.close()
    assert sorted(b.balance()[0]) == ["code", "general"]
    assert b.acquire(DISPATCH)
    b.close()


def relabel(records: list[Record]) -> list[Record]:
    """A third each of code, sql and unlabeled records."""
    domains = ("code", "sql", "")
    return [
        dataclasses.replace(r, domain=domains[i % 3], request_id=f"pool-{i}")
        for i, r in enumerate(records)
    ]


def start_worker(redis_url: str, overrides: list[str], audit: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), AUDIT_ENV: str(audit)}
    command = [sys.executable, "-m", "launcher.cli", "train", "--redis-url", redis_url]
    command += [*overrides, f"trainer.consumer={name}"]
    log = open(audit.parent / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def audited(audit: Path) -> dict[str, list[tuple[str, str]]]:
    """Each worker's audit: (adapter, request id) per record trained, in order."""
    out = {}
    for path in audit.glob("*.log"):
        lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
        out[path.stem] = [(a, r) for a, r in lines]
    return out


def held(url: str, stream: str) -> set[tuple[str, str]]:
    """(adapter, request id) of the entries adapter streams still hold (unacknowledged)."""
    client = connect(url)
    try:
        out = set()
        for adapter in ADAPTERS:
            for _, fields in client.xrange(adapter_stream(stream, adapter)):
                out.add((adapter, Record.unpack(fields[b"r"]).request_id))
        return out
    finally:
        client.close()


def wait_until_accounted(audit: Path, url: str, stream: str, routed: set, timeout_s: float = 30):
    """Waits (at most ``timeout_s``) until every routed (adapter, request id) was trained or
    is held: the workers' last rounds, however long a loaded machine makes them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        trained = {pair for lines in audited(audit).values() for pair in lines}
        if trained | held(url, stream) == routed:
            return
        time.sleep(0.1)


def test_three_workers_with_two_sigkilled_train_each_record_once_per_adapter(
    tmp_path, redis_url, stream, records
):
    logged = relabel(records[:96])
    audit = tmp_path / "audit"
    audit.mkdir()
    overrides = trainer_overrides(
        tmp_path, stream, publish_margin=0.0, pool="true", lease_s=1.5, torch_threads=1
    )
    overrides += ["model.adapters=[general,code,sql]", "routing.enabled=false"]
    group = next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.group="))
    store = open_adapter_store(str(tmp_path / "adapters"))
    workers = {n: start_worker(redis_url, overrides, audit, n) for n in ("w0", "w1", "w2")}
    client = connect(redis_url)
    try:

        def balanced() -> bool:  # one adapter each, once all three joined
            statuses = read_pool_status(client, stream, group, 10)
            return len(statuses) == 3 and all(len(s["adapters"]) == 1 for s in statuses)

        wait_until(balanced, 90, "three workers with one adapter each")
        statuses = read_pool_status(client, stream, group, 10)
        owners = {a: s["worker"] for s in statuses for a in s["adapters"]}
        assert sorted(owners) == sorted(ADAPTERS)
        assert sum(s["dispatching"] for s in statuses) == 1

        push(redis_url, stream, logged[:48])
        pointers: dict[str, list[int | None]] = defaultdict(list)
        wait_until(
            lambda: any(a == "general" for v in audited(audit).values() for a, _ in v),
            60,
            "a first step of general",
        )
        # Kill the owner of general mid-round, then (once its adapters moved) another worker.
        killed = []
        for victim in (owners["general"], owners["code"]):
            for adapter in ADAPTERS:
                pointers[adapter].append(store.current(adapter))
            workers[victim].send_signal(signal.SIGKILL)
            workers[victim].wait(timeout=10)
            killed.append(victim)
            push(redis_url, stream, logged[48:72] if len(killed) == 1 else logged[72:])
            survivors = {n for n in workers if n not in killed}
            wait_until(
                lambda s=survivors: {
                    a for st in read_pool_status(client, stream, group, 3)
                    if st["worker"] in s for a in st["adapters"]
                } == set(ADAPTERS),
                30,
                "the survivors to own every adapter",
            )  # fmt: skip

        def drained() -> bool:
            info = client.xinfo_groups(stream)[0]
            if info["pending"] or info["lag"]:
                return False
            for adapter in ADAPTERS:
                for g in client.xinfo_groups(adapter_stream(stream, adapter)):
                    if g["lag"]:
                        return False
            return True

        wait_until(drained, 60, "every record dispatched and read")
        routed = {(a, r.request_id) for r in logged for a in adapters_for(r, ADAPTERS)}
        wait_until_accounted(audit, redis_url, stream, routed)  # the last rounds
        # A loaded machine judges late: the survivors stop only once some version is out.
        wait_until(
            lambda: any(store.current(a) is not None for a in ADAPTERS),
            30,
            "a version of some adapter published",
        )
    finally:
        for process in workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in workers.values():
            process.wait(timeout=60)
        client.close()
    survivor = next(n for n in workers if n not in killed)
    assert workers[survivor].returncode == 0

    # Every (adapter, record) the records route to was trained on, or is still held by the
    # adapter's stream to judge on; nothing else was trained.
    trained_by = audited(audit)
    trained = Counter(pair for lines in trained_by.values() for pair in lines)
    still_held = held(redis_url, stream)
    assert set(trained) <= routed
    assert routed == set(trained) | still_held, routed - set(trained) - still_held
    # Trained twice only if a killed worker trained it in its last step (at most batch_records,
    # 16, fresh records), acknowledged right after the step, which the kill cut off: an
    # acknowledged record is never trained again.
    last_steps = {
        pair
        for name in killed
        for adapter in ADAPTERS
        for pair in [p for p in trained_by.get(name, []) if p[0] == adapter][-16:]
    }
    twice = {pair for pair, n in trained.items() if n > 1}
    assert twice <= last_steps, twice - last_steps
    assert max(trained.values()) <= 2
    # Every adapter's versions descend from the versions current before each kill.
    assert any(store.current(a) is not None for a in ADAPTERS)
    for adapter in ADAPTERS:
        final = store.current(adapter)
        if final is None:  # nothing published (every candidate refused): nothing before either
            assert set(pointers[adapter]) <= {None}
            continue
        chain = lineage_of(store, adapter, final)
        for before in pointers[adapter]:
            if before is not None:
                assert before in chain, (adapter, before, chain)
    print(
        f"\n[pool] killed {killed}; trained {sum(trained.values())} (adapter, record) pairs, "
        f"{len(twice)} twice; {len(still_held)} held to judge on"
    )


def lineage_of(store, adapter: str, version: int) -> list[int]:
    chain = [version]
    while (parent := store.manifest(adapter, chain[-1]).parent_version) is not None:
        chain.append(parent)
    return chain


def test_osd_train_workers_starts_a_pool_that_trains_every_adapter(
    tmp_path, redis_url, stream, records
):
    logged = relabel(records[:48])
    push(redis_url, stream, logged)
    overrides = trainer_overrides(tmp_path, stream, publish_margin=0.0, lease_s=1.5)
    overrides += ["model.adapters=[general,code,sql]", "routing.enabled=false"]
    audit = tmp_path / "audit"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), AUDIT_ENV: str(audit)}
    command = [sys.executable, "-m", "launcher.cli", "train", "--redis-url", redis_url]
    command += ["--workers", "2", "--exit-when-idle", "3", *overrides]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("pool worker") >= 2  # two members started (and logged)
    stats = [json.loads(line)["trainer_stats"] for line in done.stdout.splitlines() if line]
    assert len(stats) == 2
    # Between them they trained every adapter, each record once per adapter it routes to (the
    # rest waits in a judge window).
    trained = Counter(pair for lines in audited(audit).values() for pair in lines)
    assert {a for a, _ in trained} == set(ADAPTERS)
    assert max(trained.values()) == 1
    routed = {(a, r.request_id) for r in logged for a in adapters_for(r, ADAPTERS)}
    assert set(trained) | held(redis_url, stream) == routed


def test_an_adapter_given_up_and_taken_back_trains_no_record_twice(
    tmp_path, redis_url, stream, records, monkeypatch
):
    """Its windows held records that went back to pending when the worker gave the adapter up;
    taking it back claims them again, into empty windows."""
    from tests.trainer.conftest import headroom_draft, make_config
    from trainer.pool import PoolWorker

    audit = tmp_path / "audit"
    monkeypatch.setenv(AUDIT_ENV, str(audit))
    config = make_config(
        tmp_path, stream, "model.adapters=[general,code,sql]", "routing.enabled=false",
        pool="true", lease_s=1.0, publish_margin=0.0,
    )  # fmt: skip
    worker = PoolWorker(config, redis_url, draft=headroom_draft(), base_model_id="toy")
    logged = relabel(records[:96])
    try:
        push(redis_url, stream, logged[:48])
        worker.run(max_rounds=2)
        assert "code" in worker.members and worker.states["code"].data.holdout
        worker._drop("code")  # as when giving it up to a newcomer
        worker.leases.release("code")
        push(redis_url, stream, logged[48:])
        worker.run(exit_when_idle_s=2.0)  # takes it back, claims what its windows held
        assert "code" in worker.members
    finally:
        worker.close()
    trained = Counter(pair for lines in audited(audit).values() for pair in lines)
    assert trained and max(trained.values()) == 1, [p for p, n in trained.items() if n > 1]
    routed = {(a, r.request_id) for r in logged for a in adapters_for(r, ADAPTERS)}
    assert set(trained) | held(redis_url, stream) == routed


def test_forwarding_is_fenced_by_the_lease_and_never_forwards_an_entry_twice(
    tmp_path, redis_url, stream, records
):
    from tests.trainer.conftest import headroom_draft, make_config
    from trainer.draft_trainer import DraftTrainer
    from trainer.pool import Dispatcher

    config = make_config(tmp_path, stream, "model.adapters=[general,code,sql]", pool="true")
    trainer = DraftTrainer(headroom_draft(), config.model, ADAPTERS, base_model_id="toy")
    leases = table(redis_url, stream, "w", group=config.trainer.group)
    assert leases.acquire(DISPATCH)
    dispatcher = Dispatcher(config, redis_url, "w", trainer, dict.fromkeys(ADAPTERS))
    client = connect(redis_url)

    def lengths() -> list[int]:
        return [client.xlen(adapter_stream(stream, a)) for a in ADAPTERS]

    try:
        push(redis_url, stream, relabel(records[:6]))
        entries = dispatcher.reader.read(count=6, block_ms=0)
        dispatcher._route(entries[:3])
        assert lengths() == [3, 1, 1]  # general all, code and sql theirs
        dispatcher._unsent = [(e, b"x", [0]) for e, _ in entries[:3]]
        assert dispatcher._send() and lengths() == [3, 1, 1]  # a lost reply, retried: no copy
        # Another worker holds the dispatch lease now: nothing is forwarded or acknowledged.
        client.set(leases.key(DISPATCH), "someone else")
        dispatcher._route(entries[3:])
        assert dispatcher.lost and lengths() == [3, 1, 1]
        pending = client.xinfo_groups(stream)[0]["pending"]
        assert pending == 3  # for the next dispatcher to claim
    finally:
        dispatcher.close()
        client.close()
