"""Records of made-up topics and a made-up scorer for the content-routing tests: a topic is a
range of prompt token ids, and each adapter's score on a record depends only on its topic."""

from __future__ import annotations

import dataclasses

import numpy as np

from osd.buffer.record import Record
from trainer.examples import Example

TOPICS = {"prose": (2, 22), "code": (22, 42), "sql": (42, 62)}  # ids fit the toy vocabulary
# adapter -> topic -> the score a version of that adapter reaches on the topic's records
SCORES = {
    "general": {"prose": 0.7, "code": 0.1, "sql": 0.1},
    "code": {"prose": 0.3, "code": 0.8, "sql": 0.1},
    "sql": {"prose": 0.3, "code": 0.1, "sql": 0.8},
    "math": {"prose": 0.3, "code": 0.5, "sql": 0.5},
}


def topic_of(record: Record) -> str:
    first = int(record.token_ids[0])
    return next(t for t, (low, high) in TOPICS.items() if low <= first < high)


def topic_record(topic: str, seed: int, *, domain: str = "", served: str = "general") -> Record:
    """A record whose 12 prompt tokens come from `topic`'s id range: its 4 keywords (the
    range's first ids, in every prompt of the topic) and 8 others at random."""
    record = Record.make_dummy(
        num_generated=4,
        m=4,
        prompt_len=12,
        vocab_size=64,
        seed=seed,
        domain=domain,
        adapter_name=served,
    )
    low, high = TOPICS[topic]
    rest = np.random.default_rng(seed).integers(low + 4, high, size=8)
    prompt = np.concatenate([np.arange(low, low + 4), rest])
    token_ids = np.concatenate([prompt, record.token_ids[record.prompt_len :]])
    return dataclasses.replace(record, token_ids=token_ids, request_id=f"{topic}-{seed}")


def topic_examples(topic: str, count: int, start: int = 0, **kwargs: str) -> list[Example]:
    return [
        Example(f"{topic}-{i}", topic_record(topic, 1000 * start + i, **kwargs), float(i))
        for i in range(start, start + count)
    ]


class FakeScorer:
    """Scores by the table above; counts records scored per adapter."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __call__(self, adapter: str, records: list[Record]) -> list[float]:
        self.calls[adapter] = self.calls.get(adapter, 0) + len(records)
        return [SCORES[adapter][topic_of(r)] for r in records]
