"""Privacy of the log buffer: opted-out requests leave no record, records hold no plaintext,
old records can be removed by age, and replicas can log as a Redis user that may only append.

docs/reliability.md, "Privacy checks" and "Redis ACL for replicas" (the ACL lines tested here).
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from osd.adapters import open_adapter_store
from osd.buffer.reader import LogReader
from osd.buffer.record import Record
from osd.buffer.redis_server import LocalRedis, connect
from osd.buffer.writer import LogWriter
from osd.routing import fit_routing_model, stack_features
from osd.routing.store import open_routing_store, routing_model_name

from .conftest import STREAM, replica_adapter, running_replica, toy_config, wait_for

# The minimal ACL of a replica's log writer: AUTH needs no permission, PING checks the
# credentials, XADD appends; nothing can be read or deleted. (redis-py also sends CLIENT SETINFO,
# which it lets fail; on Redis >= 7.2 add +client|setinfo to keep the ACL log quiet.)
WRITER_ACL = "on >{pw} resetkeys ~{stream} resetchannels -@all +ping +xadd"
# A whole replica (log writer and version watchers on one URL, as serving.app builds it): also
# read adapter and routing-model versions, hear notifications, and move a pointer back on
# rollback. The rollback
# is a Lua compare-and-set (GET/EXISTS/SET/PUBLISH) that declares the pointer and the target's
# manifest as its keys, and Redis wants write access to every key a script declares; weights
# stay read-only. Its health probe reads the trainer's heartbeat and the group's lag; its watcher
# reports the versions it holds (a SET with a TTL), so that they are not deleted.
REPLICA_ACL = (
    "on >{pw} resetkeys ~{stream} %R~{stream}:trainer:* "
    "%R~osd:adapter:* %RW~osd:adapter:*:current %RW~osd:adapter:*:manifest "
    "%W~osd:adapters:held:* %R~osd:router:* %RW~osd:router:*:current "
    "%RW~osd:router:*:manifest %W~osd:routers:held:* resetchannels &osd:adapters &osd:routers "
    "-@all +ping +xadd +get +exists +set +publish +subscribe +evalsha +script|load "
    "+hgetall +xinfo|groups"
)


def stored(url: str) -> list[tuple[bytes, Record]]:
    client = connect(url)
    try:
        return [(f[b"r"], Record.unpack(f[b"r"])) for _, f in client.xrange(STREAM)]
    finally:
        client.close()


@pytest.fixture(scope="module")
def logging_replica(module_redis):
    with running_replica(toy_config(), redis_url=module_redis.url) as replica:
        yield replica


def test_opted_out_requests_leave_no_record(logging_replica, module_redis):
    replica, label = logging_replica, uuid.uuid4().hex[:8]
    opted_out_before = replica.writer.metrics().opted_out
    chat = {"model": "osd", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    for stream in (False, True):
        for log, domain in ((False, f"out-{label}"), (True, f"in-{label}")):
            assert replica.complete(log=log, domain=domain, stream=stream).status_code == 200
            body = {**chat, "log": log, "domain": domain, "stream": stream}
            assert replica.client.post("/v1/chat/completions", json=body).status_code == 200
    assert replica.writer.flush(5)
    domains = [record.domain for _, record in stored(module_redis.url)]
    print(f"\n[privacy] opt-out: {domains.count(f'out-{label}')} records of 4 opted out")
    assert domains.count(f"out-{label}") == 0
    assert domains.count(f"in-{label}") == 4
    assert replica.writer.metrics().opted_out - opted_out_before == 4


def test_record_holds_no_plaintext_of_prompt_messages_user_or_stop(logging_replica, module_redis):
    replica, marker = logging_replica, f"zq{uuid.uuid4().int % 10**8:08d}xj quokka"
    domain = uuid.uuid4().hex[:8]
    responses = [
        replica.complete(prompt=f"say {marker} now", user=marker, stop=[marker], domain=domain),
        replica.client.post(
            "/v1/chat/completions",
            json={
                "model": "osd",
                "messages": [
                    {"role": "system", "content": marker},
                    {"role": "user", "content": "x"},
                ],
                "max_tokens": 8,
                "user": marker,
                "domain": domain,
            },
        ),
    ]
    assert [r.status_code for r in responses] == [200, 200]
    assert replica.writer.flush(5)
    records = [(raw, r) for raw, r in stored(module_redis.url) if r.domain == domain]
    assert len(records) == 2
    encodings = ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le")
    for raw, record in records:
        for needle in (marker, marker.split()[0], "quokka"):
            assert all(needle.encode(e) not in raw for e in encodings), needle
        texts = (record.request_id, record.domain, record.adapter_name)
        assert all(marker not in t for t in texts)
    # No plaintext is not anonymity: the token ids decode back to the prompt with the tokenizer.
    raw, completion_record = records[0]
    decoded = replica.runtime.tokenizer.decode(completion_record.prompt_ids.tolist())
    assert marker in decoded


def test_retention_by_age_removes_only_old_records(redis_server):
    with running_replica(toy_config(), redis_url=redis_server.url) as replica:
        for _ in range(5):
            replica.complete(domain="old")
        assert replica.writer.flush(5)
        time.sleep(0.5)
        cut = time.time()  # records before this are "old"
        time.sleep(0.5)
        for _ in range(3):
            replica.complete(domain="new")
        assert replica.writer.flush(5)
    reader = LogReader(redis_server.url, STREAM, group="retention")
    max_age_s = time.time() - cut  # same machine: Redis's clock is this one
    deleted = reader.trim_older_than(max_age_s)
    left = [record.domain for _, record in stored(redis_server.url)]
    reader.close()
    print(f"\n[privacy] retention: trim_older_than({max_age_s:.2f}) deleted {deleted}, left {left}")
    assert deleted == 5
    assert left == ["new"] * 3


def _setuser(admin: redis.Redis, name: str, acl: str, pw: str) -> str:
    admin.execute_command("ACL", "SETUSER", name, *acl.format(pw=pw, stream=STREAM).split())
    return f"redis://{name}:{pw}@127.0.0.1:{admin.connection_pool.connection_kwargs['port']}/0"


@pytest.fixture
def acl_redis():
    with LocalRedis(password="admin-secret") as server:
        admin = connect(server.url)
        yield server, admin
        admin.close()


def test_writer_logs_as_an_append_only_user_that_can_read_or_delete_nothing(acl_redis):
    server, admin = acl_redis
    url = _setuser(admin, "replica", WRITER_ACL, "pw-1")
    writer = LogWriter(url, STREAM)
    for seed in range(20):
        writer.log(Record.make_dummy(seed=seed, request_id=f"acl-{seed}"))
    final = writer.close()
    assert (final.written, final.dropped) == (20, 0)
    assert admin.xlen(STREAM) == 20
    assert admin.acl_log() == []  # nothing the writer does was denied (Redis logs denials)
    user = connect(url)
    forbidden = {
        "XRANGE": lambda: user.xrange(STREAM),
        "XREAD": lambda: user.xread({STREAM: "0"}),
        "XREADGROUP": lambda: user.xreadgroup("g", "c", {STREAM: ">"}),
        "XLEN": lambda: user.xlen(STREAM),
        "XTRIM": lambda: user.xtrim(STREAM, maxlen=0),
        "XDEL": lambda: user.xdel(STREAM, "0-1"),
        "DEL": lambda: user.delete(STREAM),
        "GET": lambda: user.get("osd:adapter:general:current"),
        "XADD to another key": lambda: user.xadd("other", {"r": b"x"}),
        "KEYS": lambda: user.keys("*"),
        "FLUSHALL": lambda: user.flushall(),
        "CONFIG": lambda: user.config_get("*"),
    }
    for name, call in forbidden.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
            pytest.fail(f"{name} was allowed")
    user.close()
    assert admin.xlen(STREAM) == 20
    assert len(admin.acl_log(count=100)) == len(forbidden)  # each attempt was logged


def test_whole_replica_runs_as_a_user_that_cannot_write_adapter_versions(acl_redis):
    server, admin = acl_redis
    url = _setuser(admin, "replica", REPLICA_ACL, "pw-2")
    store = open_adapter_store(server.url)  # the trainer, as admin
    replica_store = open_adapter_store(url)
    # This user may not read the log, so the suffix store starts cold (no warm-up read).
    config = toy_config("spec.suffix_warm_records=0")
    with running_replica(config, redis_url=url, store=replica_store) as replica:
        spec, identity = replica_adapter(replica.runtime.slots.model)
        first = store.publish("general", identity, spec=spec, expected_current=None).version
        second = store.publish("general", identity, spec=spec, expected_current=first).version
        wait_for(lambda: replica.current() == second, 10)
        wait_for(lambda: second in store.held_versions("general"), 5)  # its report got through
        assert replica.complete().status_code == 200
        assert replica.writer.flush(5)
        assert replica.writer.metrics().written >= 1
    # The watcher's rollback path: a compare-and-set of the pointer, allowed; with an empty
    # script cache (as after a Redis restart), so that the script is loaded as this user.
    admin.script_flush()
    replica_store.rollback("general", first, expected_current=second)
    assert store.current("general") == first
    # The routing-model watcher's reads and its trial rollback, as this user too.
    trainer_router, replica_router = open_routing_store(server.url), open_routing_store(url)
    name = routing_model_name(STREAM)
    model = fit_routing_model(stack_features([[1, 2], [3, 4]]), ["general"] * 2, ["general"])
    old = trainer_router.publish(name, model, expected_current=None, score=0.5).version
    new = trainer_router.publish(name, model, expected_current=old, score=0.6).version
    assert replica_router.current(name) == new
    assert replica_router.load(name, new)[1].classes == ("general",)
    replica_router.report_held("replica-1", {name: [new, old]}, ttl_s=10)
    replica_router.rollback(name, old, expected_current=new)
    assert trainer_router.current(name) == old
    trainer_router.close()
    replica_router.close()
    user = connect(url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.set(f"osd:adapter:general:v{first}:weights", b"evil")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.set(f"osd:router:{name}:v{new}:model", b"evil")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.xrange(STREAM)
    user.close()
    denied = [entry for entry in admin.acl_log(count=100) if entry.get("username") == "replica"]
    assert len(denied) == 3  # the three attempts above, nothing from the replica itself
