"""What the trainer tells replicas about itself: a small Redis hash, its heartbeat.

The trainer (`trainer.heartbeat`) writes the hash every few seconds from a thread of its own; a
replica's health probe (`serving.health`) reads it with the consumer group's lag, so that
``/health`` can say whether anything is consuming the log. One hash per stream and consumer
group (one trainer per group). Times are Unix seconds; nothing in it is text from requests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import redis

from osd.buffer.stream_info import text

__all__ = ["TrainerBeat", "read_beat", "trainer_beat_key", "write_beat"]

_KEEP_S = 7 * 24 * 3600  # an abandoned hash expires after a week; a live trainer renews it


def trainer_beat_key(stream: str, group: str) -> str:
    """The hash a trainer consuming ``stream`` as ``group`` writes its heartbeat to."""
    return f"{stream}:trainer:{group}"


@dataclass(frozen=True)
class TrainerBeat:
    """One heartbeat.

    Attributes:
        pid: the trainer process.
        alive_at: when the heartbeat thread last wrote (the process is alive).
        loop_at: when the training loop last came round (it is not stuck in a round).
        last_ack_at: when Redis last confirmed an acknowledgement (0: none yet).
        rounds: training rounds run since the trainer started.
        started_at: when it started.
        judging: records it holds only to judge candidates on (pending in the group by design
            until newer records push them into training; not a backlog).
    """

    pid: int
    alive_at: float
    loop_at: float
    last_ack_at: float
    rounds: int
    started_at: float
    judging: int = 0


def write_beat(client: redis.Redis, key: str, beat: TrainerBeat) -> None:
    """Writes ``beat`` (one round trip); Redis errors are the caller's to handle."""
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, mapping={k: repr(v) for k, v in dataclasses.asdict(beat).items()})
    pipe.expire(key, _KEEP_S)
    pipe.execute()


def read_beat(client: redis.Redis, key: str) -> TrainerBeat | None:
    """The last heartbeat at ``key``; None when no trainer wrote one (or it is malformed)."""
    raw: dict[Any, Any] = client.hgetall(key)  # type: ignore[assignment]
    fields = {text(k): text(v) for k, v in raw.items()}
    try:
        return TrainerBeat(
            pid=int(fields["pid"]),
            alive_at=float(fields["alive_at"]),
            loop_at=float(fields["loop_at"]),
            last_ack_at=float(fields["last_ack_at"]),
            rounds=int(fields["rounds"]),
            started_at=float(fields["started_at"]),
            judging=int(fields.get("judging", "0")),  # absent from an older trainer's beats
        )
    except (KeyError, ValueError):
        return None


def pool_status_key(stream: str, group: str) -> str:
    """The hash where each worker of a trainer pool (`trainer.pool`) reports its status."""
    return f"{trainer_beat_key(stream, group)}:workers"


def read_pool_status(
    client: redis.Redis, stream: str, group: str, max_age_s: float
) -> list[dict[str, Any]]:
    """The pool's workers as they last reported within `max_age_s` (worker id, pid, adapters,
    whether it dispatches, each adapter stream's lag and pending entries, rounds, published),
    by worker id; empty when no pool trains on this stream."""
    import json
    import time

    now, out = time.time(), []
    for raw in client.hgetall(pool_status_key(stream, group)).values():  # HGETALL: replicas' ACL
        try:
            status = json.loads(raw)
        except ValueError:
            continue
        if isinstance(status, dict) and now - float(status.get("at", 0)) <= max_age_s:
            out.append(status)
    return sorted(out, key=lambda s: str(s.get("worker")))
