"""Which versions a store may delete: a bounded history, never what a replica may load.

Issue 17 ("Bounded memory, planned"): every published version used to be kept forever. A store
now keeps, per name (an adapter, the routing model),

- the current version (what the pointer names),
- `keep_versions` predecessors (the newest versions below the current one), so that a replica's
  rollback (`serving.watcher`) and the trainer's restore after one find the version they need,
- every version a live replica reports holding (its current and the one it may roll back to;
  reports expire after a TTL, so a dead replica pins nothing for long),
- every version published less than `grace_s` ago (a version between its write and the pointer
  move, or one a replica was told about and is fetching right now);

and deletes the rest (`osd.versions.store.VersionedStore.collect_garbage`). The pointer is checked
again atomically with the delete, so the pointer never names a deleted version; a load racing
a delete gets `VersionNotFound`, which replicas treat as a refused version, never a crash.

Pure: the standard library only. The stores call these functions; the I/O is theirs.
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence

from osd.versions.errors import BASE_VERSION

__all__ = [
    "check_replica_id",
    "decode_held",
    "encode_held",
    "held_by_any",
    "make_replica_id",
    "unkept_versions",
]

_REPLICA_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_replica_id(replica_id: object) -> None:
    """Raises ValueError unless `replica_id` is 1-64 of [A-Za-z0-9_.-], starting alphanumeric
    (it becomes part of a Redis key or a file name)."""
    if not isinstance(replica_id, str) or not _REPLICA_ID_RE.fullmatch(replica_id):
        raise ValueError(
            "replica id must be 1-64 characters of [A-Za-z0-9_.-] starting with a letter or "
            f"digit, got {replica_id!r:.80}"
        )


def make_replica_id() -> str:
    """A fresh id for one replica process: ``<host>-<pid>-<random>``, made key-safe."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()).strip("-.") or "host"
    return f"{host[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def unkept_versions(versions: Sequence[int], current: int | None, keep_versions: int) -> list[int]:
    """The versions outside the bounded history: not current and not among the `keep_versions`
    newest below it. With no current version (none published, or rolled back to the base draft,
    `BASE_VERSION`) the `keep_versions` newest of all are kept.

    Args:
        versions: the stored versions, any order.
        current: what the pointer names.
        keep_versions: predecessors kept besides the current version, >= 1.

    Returns:
        Candidates for deletion, ascending; the caller still spares held and young ones.
    """
    if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) or keep_versions < 1:
        raise ValueError(f"keep_versions must be an int >= 1, got {keep_versions!r}")
    ordered = sorted(set(versions))
    if current is None or current == BASE_VERSION:
        below = ordered
    else:
        below = [v for v in ordered if v < current]
    kept = set(below[-keep_versions:]) | {current}
    return [v for v in ordered if v not in kept]


def encode_held(held: Mapping[str, Iterable[int]], ttl_s: float) -> bytes:
    """A replica's report: name -> versions it holds, and how long the report lasts."""
    versions = {
        name: sorted({int(v) for v in vs if v != BASE_VERSION}) for name, vs in held.items()
    }
    return json.dumps({"ttl_s": float(ttl_s), "held": versions}, sort_keys=True).encode()


def decode_held(raw: bytes | str) -> tuple[float, dict[str, list[int]]]:
    """`(ttl_s, held)` of a report made by `encode_held`.

    Raises:
        ValueError: not such a report.
    """
    try:
        payload = json.loads(raw)
        ttl_s, held = float(payload["ttl_s"]), payload["held"]
        parsed = {str(name): [int(v) for v in vs] for name, vs in held.items()}
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a held-versions report: {raw!r:.80} ({exc})") from exc
    return ttl_s, parsed


def held_by_any(reports: Iterable[bytes], name: str) -> Collection[int]:
    """The versions of `name` that any of `reports` names; unreadable reports are skipped."""
    held: set[int] = set()
    for raw in reports:
        try:
            held.update(decode_held(raw)[1].get(name, ()))
        except ValueError:
            continue
    return held
