"""What Redis says about a log stream's consumer group (``XINFO GROUPS``), read in one place
for the trainer's reader (`osd.buffer.reader`) and a replica's health probe (`serving.health`),
and the reader's snapshot of the stream, the group and its own counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

__all__ = ["GroupInfo", "ReaderMetrics", "group_info", "read_group_info", "text"]


@dataclass(frozen=True)
class GroupInfo:
    """One consumer group of a stream.

    Attributes:
        pending: entries delivered to the group and not acknowledged.
        lag: entries never delivered to the group (None when Redis cannot tell, e.g. after
            deletions, or before Redis 7).
        last_delivered_id: the newest entry delivered to the group.
    """

    pending: int
    lag: int | None
    last_delivered_id: str | None


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def group_info(groups: list[dict[Any, Any]], group: str) -> GroupInfo | None:
    """``group`` among the answer of ``XINFO GROUPS`` (redis-py's list of dicts); None if the
    group does not exist."""
    for entry in groups:
        if text(entry["name"]) != group:
            continue
        last, lag = entry.get("last-delivered-id"), entry.get("lag")
        return GroupInfo(
            pending=int(entry["pending"]),
            lag=None if lag is None else int(lag),
            last_delivered_id=None if last is None else text(last),
        )
    return None


def read_group_info(client: redis.Redis, stream: str, group: str) -> GroupInfo | None:
    """Asks Redis about ``group`` of ``stream``; None when the stream or the group does not
    exist yet. Other Redis errors are the caller's."""
    try:
        groups: list[dict[Any, Any]] = client.xinfo_groups(stream)  # type: ignore[assignment]
    except redis.ResponseError:  # no such stream
        return None
    return group_info(groups, group)


@dataclass(frozen=True)
class ReaderMetrics:
    """A snapshot of the stream, the group and this reader's counters.

    Fields read from Redis are None when it cannot be reached.

    Attributes:
        stream_length: entries in the stream (XLEN).
        pending: entries delivered to the group and not yet acknowledged.
        last_delivered_id: the group's last delivered entry id.
        lag: entries not yet delivered to the group (Redis >= 7; None if unknown).
        dead_letters: entries in the dead-letter stream.
        read: entries this reader returned (new or claimed).
        claimed: entries this reader took over from other consumers.
        acked: entries this reader acknowledged.
        dead_lettered: entries this reader moved to the dead-letter stream.
        redelivered: entries delivered again after this reader had acknowledged them (or while
            their acknowledgement waited for Redis); not returned, acknowledged again.
        connected: whether the last call to Redis succeeded.
    """

    stream_length: int | None
    pending: int | None
    last_delivered_id: str | None
    lag: int | None
    dead_letters: int | None
    read: int
    claimed: int
    acked: int
    dead_lettered: int
    redelivered: int
    connected: bool
