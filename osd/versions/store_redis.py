"""The versioned store in Redis, for deployments without a shared filesystem.

Keys, with ``<ns>`` the store's namespace (``adapter`` for the draft adapters, ``router`` for the
content router's model) and ``<name>`` a name, which never contains ':'::

    osd:<ns>:<name>:v<version>:<payload_key> the codec's payload (adapters: ``weights``)
    osd:<ns>:<name>:v<version>:manifest      the codec's manifest JSON, written once
    osd:<ns>:<name>:versions                 sorted set of complete versions
    osd:<ns>:<name>:last_version             INCR counter handing out version numbers
    osd:<ns>:<name>:current                  the pointer
    osd:<ns>-names                           set of names
    osd:<ns>s:held:<replica-id>              what a replica holds (`report_held`), with a TTL

A version's payload, manifest and index entries are written in one MULTI/EXEC transaction,
WATCHing the two version keys so an existing version is never overwritten. The pointer moves in
a Lua script that compares, checks the target version is complete, sets and PUBLISHes
``{"name": ..., "version": ...}`` on channel ``osd:<ns>s``, all atomically; a version is
deleted by another script that first checks the pointer does not name it. The keys of one
name are not hash-tagged: this is for a single Redis (with AOF), not Redis Cluster.

A Redis at its ``maxmemory`` (policy ``noeviction``, which keeps these keys safe) refuses
writes with an OOM error: that is `StoreUnavailable`, since it passes once the log stream
is trimmed or old versions are deleted (reads, deletes and trims still work then).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import redis

from osd.buffer.redis_server import connect, redact_url
from osd.versions.codec import Codec
from osd.versions.errors import (
    PointerEvent,
    PublishConflict,
    StoreError,
    StoreUnavailable,
    check_name,
)
from osd.versions.store import Subscription, VersionedStore

__all__ = ["DEFAULT_REDIS_MAX_BYTES", "RedisStore", "RedisSubscription"]

_log = logging.getLogger(__name__)

DEFAULT_REDIS_MAX_BYTES = 64 * 2**20  # Redis strings are capped at 512 MiB; stay well below.

# KEYS: pointer, manifest of the new version. ARGV: expected ('' = none), new, channel, message.
# Returns {status, actual}: 1 moved, 0 pointer was not `expected`, -1 no such version.
_CAS_SCRIPT = """
local actual = redis.call('GET', KEYS[1]) or ''
if actual ~= ARGV[1] then return {0, actual} end
if ARGV[2] ~= '0' and redis.call('EXISTS', KEYS[2]) == 0 then return {-1, actual} end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return {1, actual}
"""


# KEYS: pointer, versions index, weights, manifest. ARGV: version. Returns 1 deleted, 0 not.
_DELETE_SCRIPT = """
if (redis.call('GET', KEYS[1]) or '') == ARGV[1] then return 0 end
local found = redis.call('UNLINK', KEYS[3], KEYS[4])
redis.call('ZREM', KEYS[2], ARGV[1])
if found > 0 then return 1 end
return 0
"""


def _as_version(raw: Any, where: str) -> int | None:
    if raw is None or raw in (b"", ""):
        return None
    text = _as_text(raw)
    if not text.isdigit():
        raise StoreError(f"{where} should hold a version number, holds {text[:40]!r}")
    return int(text)


def _as_bytes(raw: Any) -> bytes | None:
    """A GET reply as bytes (the client does not decode responses)."""
    if raw is None or isinstance(raw, bytes):
        return raw
    return str(raw).encode()


def _as_text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


@contextlib.contextmanager
def _redis_errors(what: str) -> Iterator[None]:
    try:
        yield
    except redis.AuthenticationError as exc:  # a ConnectionError, but retrying cannot help
        raise StoreError(f"Redis rejected the credentials while {what}: {exc}") from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:  # also BusyLoadingError
        raise StoreUnavailable(f"Redis unreachable while {what}: {exc}") from exc
    except redis.exceptions.OutOfMemoryError as exc:
        raise StoreUnavailable(
            f"Redis is full (maxmemory) while {what}: {exc}; the log stream's trimming or "
            "collect_garbage frees room, or raise maxmemory"
        ) from exc
    except redis.RedisError as exc:
        raise StoreError(f"Redis failed while {what}: {exc}") from exc


class RedisStore(VersionedStore[Any, Any]):
    """Versions, pointers and notifications in one Redis.

    Args:
        url: ``redis://[[user]:password@]host:port/db``.
        codec: what a version holds (`osd.versions.codec`).
        namespace: the keys' and channel's prefix (see the module docstring).
        max_bytes: largest payload accepted (each version is one Redis string).
        socket_timeout_s: per-command timeout; weights are sent in one command.
    """

    def __init__(
        self,
        url: str,
        codec: Codec[Any, Any],
        *,
        namespace: str = "adapter",
        max_bytes: int = DEFAULT_REDIS_MAX_BYTES,
        socket_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(codec, max_bytes=max_bytes)
        check_name(namespace, "namespace")
        self.url, self.namespace = url, namespace
        self.channel = f"osd:{namespace}s"
        self.names_key = f"osd:{namespace}-names"
        self.held_prefix = f"osd:{namespace}s:held:"
        self._client = connect(url, socket_timeout_s=socket_timeout_s)
        self._cas = self._client.register_script(_CAS_SCRIPT)
        self._delete = self._client.register_script(_DELETE_SCRIPT)

    def __repr__(self) -> str:
        return f"RedisStore({redact_url(self.url)!r}, namespace={self.namespace!r})"

    def _key(self, name: str, suffix: str) -> str:
        check_name(name, self.codec.kind)
        return f"osd:{self.namespace}:{name}:{suffix}"

    def close(self) -> None:
        """Closes the connection pool."""
        self._client.close()

    def current(self, name: str) -> int | None:
        key = self._key(name, "current")
        with _redis_errors(f"reading {key}"):
            return _as_version(self._client.get(key), key)

    def list_versions(self, name: str) -> list[int]:
        key = self._key(name, "versions")
        with _redis_errors(f"reading {key}"):
            return sorted(int(_as_text(v)) for v in self._client.zrange(key, 0, -1))

    def names(self) -> list[str]:
        with _redis_errors(f"reading {self.names_key}"):
            return sorted(_as_text(n) for n in self._client.smembers(self.names_key))

    def subscribe(self, timeout_s: float = 5.0) -> RedisSubscription:
        """Listens on the namespace's channel. Returns once Redis confirmed the subscription, so
        every pointer move after this call is heard (unless the connection drops).

        Raises:
            StoreError: Redis unreachable, or no confirmation within `timeout_s`.
        """
        pubsub = self._client.pubsub()
        deadline = time.monotonic() + timeout_s
        with _redis_errors(f"subscribing to {self.channel}"):
            pubsub.subscribe(self.channel)
            while time.monotonic() < deadline:
                message = pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
                if message is not None and message.get("type") == "subscribe":
                    return RedisSubscription(pubsub, self.channel)
        pubsub.close()
        raise StoreError(f"Redis did not confirm the subscription to {self.channel}")

    def _allocate_version(self, name: str) -> int:
        key = self._key(name, "last_version")
        with _redis_errors(f"incrementing {key}"):
            return int(self._client.incr(key))

    def _write_version(self, manifest: Any, payload: bytes) -> None:
        name, version = manifest.name, manifest.version
        weights_key = self._key(name, f"v{version}:{self.codec.payload_key}")
        manifest_key = self._key(name, f"v{version}:manifest")
        with _redis_errors(f"storing {manifest.ref}"), self._client.pipeline() as pipe:
            pipe.watch(weights_key, manifest_key)
            if pipe.exists(weights_key, manifest_key):
                raise StoreError(f"{manifest.ref} exists already; versions are immutable")
            pipe.multi()
            pipe.set(weights_key, payload)
            pipe.set(manifest_key, manifest.to_json())
            pipe.zadd(self._key(name, "versions"), {str(version): version})
            pipe.sadd(self.names_key, name)
            # A WatchError here means someone wrote this version meanwhile: nothing was written.
            pipe.execute()

    def _read_manifest(self, name: str, version: int) -> bytes | None:
        key = self._key(name, f"v{version}:manifest")
        with _redis_errors(f"reading {key}"):
            return _as_bytes(self._client.get(key))

    def _read_payload(self, name: str, version: int) -> bytes | None:
        key = self._key(name, f"v{version}:{self.codec.payload_key}")
        with _redis_errors(f"reading {key}"):
            return _as_bytes(self._client.get(key))

    def _compare_and_set(self, name: str, expected: int | None, new: int) -> None:
        pointer = self._key(name, "current")
        message = json.dumps({"name": name, "version": new})
        args = ["" if expected is None else str(expected), str(new), self.channel, message]
        with _redis_errors(f"moving {pointer}"):
            status, actual = self._cas(
                keys=[pointer, self._key(name, f"v{new}:manifest")], args=args
            )
        if status == 0:
            raise PublishConflict(name, expected, _as_version(actual, pointer), new)
        if status == -1:
            raise self._not_found(name, new)

    def _delete_version(self, name: str, version: int) -> bool:
        keys = [self._key(name, suffix) for suffix in ("current", "versions")]
        keys += [
            self._key(name, f"v{version}:{part}") for part in (self.codec.payload_key, "manifest")
        ]
        with _redis_errors(f"deleting {name} v{version}"):
            return bool(self._delete(keys=keys, args=[str(version)]))

    def _write_held(self, replica_id: str, report: bytes, ttl_s: float) -> None:
        # One SET: a replica's Redis user needs write access to self.held_prefix keys only.
        key = self.held_prefix + replica_id
        with _redis_errors(f"writing {key}"):
            self._client.set(key, report, px=max(1, round(ttl_s * 1e3)))

    def _read_held(self) -> list[bytes]:
        # SCAN walks the keyspace (a few keys per version): fine once per publish.
        with _redis_errors(f"reading the {self.held_prefix}* reports"):
            keys = list(self._client.scan_iter(match=f"{self.held_prefix}*", count=1000))
            reports = self._client.mget(keys) if keys else []
        return [raw for raw in (_as_bytes(r) for r in reports) if raw is not None]


class RedisSubscription(Subscription):
    """Pointer-move notifications from a store's channel. Messages are not queued while no one
    listens, and can be lost on reconnects: reconcile with `changed_pointers` too."""

    def __init__(self, pubsub: redis.client.PubSub, channel: str) -> None:
        self._pubsub, self.channel = pubsub, channel

    def get(self, timeout_s: float) -> PointerEvent | None:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            with _redis_errors(f"listening on {self.channel}"):
                message = self._pubsub.get_message(timeout=remaining)
            if message is not None and message.get("type") == "message":
                event = _parse_event(message.get("data"), self.channel)
                if event is not None:
                    return event
            if time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        self._pubsub.close()


def _parse_event(data: Any, channel: str) -> PointerEvent | None:
    """The event in a notification, or None (logged) for a malformed one."""
    try:
        payload = json.loads(data)
        name, version = payload["name"], payload["version"]
        check_name(name)
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ValueError(f"version must be an int or null, got {version!r}")
        return PointerEvent(name=name, version=version)
    except (ValueError, TypeError, KeyError) as exc:
        _log.warning("ignoring malformed message on %s: %r (%s)", channel, data, exc)
        return None
