"""A replica's suffix store warms from the newest records of the log stream (real Redis)."""

from __future__ import annotations

import time

from osd.buffer.record import Record
from osd.buffer.redis_server import connect
from osd.decode.proposers import LookupSettings, Proposers
from osd.decode.proposers.token_index import continuations
from serving.suffix_warmup import SuffixWarmup


def record(i: int, tokens: list[int], domain: str = "sql") -> Record:
    dummy = Record.make_dummy(num_generated=4, m=2, prompt_len=len(tokens) - 4)
    fields = {f: getattr(dummy, f) for f in dummy.__dataclass_fields__}
    return Record(**{**fields, "request_id": f"r-{i}", "domain": domain, "token_ids": tokens})


def test_a_replica_warms_its_suffix_store_from_the_stream(serving_redis):
    stream = f"warm-{time.monotonic_ns()}"
    client = connect(serving_redis.url)
    for i in range(250):  # more than one page; the oldest 50 are beyond the warm count
        client.xadd(stream, {"r": record(i, [500 + i, 1, 2, 3, 4, 5, 6, 7, 8, 9]).pack()})
    client.xadd(stream, {"r": b"not a record"})  # skipped, not fatal
    proposers = Proposers(LookupSettings(budget=100_000))
    warm = SuffixWarmup(proposers, serving_redis.url, stream, max_records=200).start()
    assert warm.done.wait(30)
    assert warm.error == "" and warm.records == 200 and warm.tokens == 200 * 10
    segments = proposers.lookups["suffix"].store("").segments
    newest = continuations([749, 1, 2], segments, 4)
    assert newest is not None and newest.tokens == (3, 4, 5, 6)
    assert continuations([550, 1, 2], segments, 4) is not None  # the oldest one read
    assert continuations([549, 1, 2], segments, 4) is None  # older than the newest 200
    assert proposers.lookups["ngram"].num_tokens() == 0  # prompt lookup keeps no store


def test_an_unreachable_redis_costs_the_warm_start_only():
    proposers = Proposers(LookupSettings())
    warm = SuffixWarmup(proposers, "redis://127.0.0.1:1/0", "osd:records", 100).start()
    assert warm.done.wait(30)
    assert warm.error and warm.records == 0
