"""Versions of the content router's model in Redis: published, pointed at, rolled back.

The routing model follows the adapters' rules (`osd.adapters.store`): a version is immutable once
written, one pointer names the current one and moves only by compare-and-set, so a replica that
rolls a loser back and a trainer that publishes over it never both win. Keys, under the log
stream's name (the log's Redis is the one every replica and the trainer reach)::

    <stream>:router:last_version   INCR counter handing out version numbers
    <stream>:router:v<version>     hash: model (safetensors bytes), created_at, score
    <stream>:router:current        the pointer ("" or missing: no model, route as before)
    <stream>:router:stats          list of JSON routing-accuracy points (newest last, capped)

Old versions are deleted past the newest `keep_versions + 1` (so a rollback always finds its
predecessor), never the current one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from osd.buffer.redis_server import connect
from osd.routing.model import RoutingModel

__all__ = [
    "RouterConflict",
    "RouterStore",
    "RouterStoreError",
    "RouterStoreUnavailable",
    "RouterVersion",
]

MAX_STATS = 2000

# KEYS: pointer. ARGV: expected ('' = none), new, the new version's hash key. The version key is
# an argument, not a declared key, so a replica's Redis user needs only read access to it
# (Redis asks write access for every declared key; docs/reliability.md, "Redis ACL").
# Returns {1, actual} moved, {0, actual} the pointer was not `expected`, {-1, actual} no version.
_CAS_SCRIPT = """
local actual = redis.call('GET', KEYS[1]) or ''
if actual ~= ARGV[1] then return {0, actual} end
if ARGV[2] ~= '' and redis.call('EXISTS', ARGV[3]) == 0 then return {-1, actual} end
redis.call('SET', KEYS[1], ARGV[2])
return {1, actual}
"""


class RouterStoreError(RuntimeError):
    """Redis failed or holds something that is not a routing model."""


class RouterStoreUnavailable(RouterStoreError):
    """Redis did not answer (or failed): says nothing about the version asked for."""


class RouterConflict(RouterStoreError):
    """The pointer had moved (a replica rolled back, or another trainer published)."""

    def __init__(self, expected: int | None, actual: int | None) -> None:
        super().__init__(f"router pointer is at {actual}, not {expected}")
        self.expected, self.actual = expected, actual


@dataclass(frozen=True)
class RouterVersion:
    version: int
    model: RoutingModel
    created_at: float
    score: float | None


def _version(raw: Any) -> int | None:
    text = raw.decode() if isinstance(raw, bytes) else (raw or "")
    if not text:
        return None
    if not str(text).isdigit():
        raise RouterStoreError(f"router pointer holds {str(text)[:40]!r}, not a version")
    return int(text)


class RouterStore:
    """The routing model's versions in the log's Redis.

    Args:
        url: the log buffer's Redis URL.
        stream: the log stream's name (keys live under it).
        keep_versions: versions kept besides the newest (at least 1, for rollbacks).
    """

    def __init__(self, url: str, stream: str, *, keep_versions: int = 4) -> None:
        self._client = connect(url)
        self.prefix = f"{stream}:router"
        self.keep_versions = max(1, keep_versions)
        self._cas = self._client.register_script(_CAS_SCRIPT)

    def _key(self, suffix: str) -> str:
        return f"{self.prefix}:{suffix}"

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as exc:
            raise RouterStoreUnavailable(f"Redis failed while {what}: {exc}") from exc

    def current(self) -> int | None:
        """The version the pointer names, or None."""
        return _version(
            self._call("reading the router pointer", self._client.get, self._key("current"))
        )

    def load(self, version: int) -> RouterVersion:
        """Reads and checks one version.

        Raises:
            RouterStoreError: missing, or not a routing model.
        """
        raw = self._call("loading a router version", self._client.hgetall, self._key(f"v{version}"))
        if not raw or b"model" not in raw:
            raise RouterStoreError(f"router version {version} is not stored")
        try:
            model = RoutingModel.from_bytes(raw[b"model"])
            created_at = float(raw.get(b"created_at", b"0"))
            score = raw.get(b"score")
            return RouterVersion(version, model, created_at, float(score) if score else None)
        except ValueError as exc:
            raise RouterStoreError(f"router version {version}: {exc}") from exc

    def publish(self, model: RoutingModel, *, expected_current: int | None, score: float) -> int:
        """Stores `model` as a new version and moves the pointer to it if it still names
        `expected_current`; returns the new version.

        Raises:
            RouterConflict: the pointer had moved (the version stays stored, not current).
        """
        version = int(
            self._call("numbering a router version", self._client.incr, self._key("last_version"))
        )
        fields = {"model": model.to_bytes(), "created_at": repr(time.time()), "score": repr(score)}
        self._call(
            "writing a router version", self._client.hset, self._key(f"v{version}"), mapping=fields
        )
        self._move(expected_current, version)
        self._collect(version)
        return version

    def rollback(self, to_version: int | None, *, expected_current: int | None) -> None:
        """Points back at `to_version` (None: no model) if the pointer names `expected_current`.

        Raises:
            RouterConflict: it did not.
        """
        self._move(expected_current, to_version)

    def _move(self, expected: int | None, new: int | None) -> None:
        status, actual = self._call(
            "moving the router pointer",
            self._cas,
            keys=[self._key("current")],
            args=[
                "" if expected is None else str(expected),
                "" if new is None else str(new),
                self._key(f"v{new}"),
            ],
        )
        if int(status) != 1:
            raise RouterConflict(expected, _version(actual))

    def _collect(self, newest: int) -> None:
        """Deletes versions older than the newest `keep_versions + 1`, bar the current one."""
        current = self.current()
        cutoff = newest - self.keep_versions - 1  # and the 16 before it, left by a crash
        doomed = [
            self._key(f"v{v}") for v in range(max(1, cutoff - 16), cutoff + 1) if v != current
        ]
        if doomed:
            self._call("deleting old router versions", self._client.unlink, *doomed)

    def add_stats(self, point: dict[str, Any]) -> None:
        """Appends one routing-accuracy point (JSON), keeping the newest `MAX_STATS`."""
        key = self._key("stats")
        pipe = self._client.pipeline()
        pipe.rpush(key, json.dumps(point, sort_keys=True))
        pipe.ltrim(key, -MAX_STATS, -1)
        self._call("writing routing stats", pipe.execute)

    def stats(self) -> list[dict[str, Any]]:
        """Every kept routing-accuracy point, oldest first."""
        raw = self._call("reading routing stats", self._client.lrange, self._key("stats"), 0, -1)
        return [json.loads(item) for item in raw]

    def close(self) -> None:
        self._client.close()
