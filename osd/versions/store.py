"""Versioned artefacts: immutable versions, one compare-and-set pointer per name, notifications.

docs/design.md, "Versioned store": the draft adapters and the content router's model are kept
the same way, each through its codec (`osd.versions.codec`): a version is immutable once
published (the codec's payload plus its manifest); a single pointer per name says which version
is current; a notification tells replicas to look, and replicas also reconcile against the
pointer (`VersionedStore.changed_pointers`), since notifications can be lost.

Publishing is three steps, in this order, so a crash never exposes a half-written version:

1. allocate a fresh version number (monotonic, never reused; a crash may leave gaps);
2. write payload and manifest atomically (a backend's temp dir + rename, or one Redis
   transaction); a version that exists is complete, and is never written again;
3. move the pointer with compare-and-set against the version the publisher last saw
   (`expected_current`), then notify. A publisher that lost the race gets `PublishConflict`; its
   version stays stored but is not current.

`load` trusts nothing it reads: the manifest must describe the version asked for, the size must
be under `max_bytes`, and the codec checks the rest (sha256, safetensors, never pickle; for
adapters the base model hash, rank and shapes). History is bounded: `collect_garbage` deletes
versions no rollback or replica needs any more (the rules are in `osd.versions.retention`;
replicas name what they hold with `report_held`). Backends: `osd.versions.store_dir.DirectoryStore`
(shared filesystem) and `osd.versions.store_redis.RedisStore`; `osd.versions.open_store` picks
one by location.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

from osd.closing import Closeable
from osd.versions.codec import Codec, Manifest, NewVersion
from osd.versions.errors import (
    BASE_VERSION,
    PointerEvent,
    VersionIntegrityError,
    VersionNotFound,
    VersionTooLarge,
    check_name,
    check_version,
)
from osd.versions.retention import check_replica_id, encode_held, held_by_any, unkept_versions

__all__ = ["DEFAULT_MAX_BYTES", "Subscription", "VersionedStore"]

DEFAULT_MAX_BYTES = 256 * 2**20

A = TypeVar("A")
M = TypeVar("M", bound=Manifest)


class Subscription(Closeable, abc.ABC):
    """Notifications of pointer moves; use as a context manager, or call `close`."""

    @abc.abstractmethod
    def get(self, timeout_s: float) -> PointerEvent | None:
        """The next event, or None if none came within `timeout_s` seconds."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops listening and frees the connection, if any."""


class VersionedStore(abc.ABC, Generic[A, M]):
    """Immutable versions of one kind of artefact plus a compare-and-set pointer per name.

    Backends implement the storage primitives (the abstract methods); publishing, loading,
    retention and their checks live here, once; what a version holds is `codec`'s.

    Args:
        codec: turns artefacts into payload and manifest and back, with their checks.
        max_bytes: largest payload accepted by `publish` and `load`.
    """

    def __init__(self, codec: Codec[A, M], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.codec = codec
        self.max_bytes = max_bytes

    # Storage primitives.

    @abc.abstractmethod
    def current(self, name: str) -> int | None:
        """The version the pointer of `name` names, or None if none was ever published
        (`BASE_VERSION`, 0: rolled back past the first version, to the artefact's base)."""

    @abc.abstractmethod
    def list_versions(self, name: str) -> list[int]:
        """All complete versions of `name`, ascending (current or not)."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """All names with at least one stored version, sorted."""

    @abc.abstractmethod
    def subscribe(self) -> Subscription:
        """Starts listening for pointer moves of every name."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees connections, if any."""

    @abc.abstractmethod
    def _allocate_version(self, name: str) -> int:
        """A version number of `name` never handed out before, larger than all earlier ones."""

    @abc.abstractmethod
    def _write_version(self, manifest: M, payload: bytes) -> None:
        """Stores payload and manifest so that both or neither become visible."""

    @abc.abstractmethod
    def _read_manifest(self, name: str, version: int) -> bytes | None:
        """The manifest bytes of a complete version, or None."""

    @abc.abstractmethod
    def _read_payload(self, name: str, version: int) -> bytes | None:
        """The payload bytes of a version, or None."""

    @abc.abstractmethod
    def _compare_and_set(self, name: str, expected: int | None, new: int) -> None:
        """Atomically: if the pointer names `expected` and version `new` is complete, point at
        `new` and notify; raises PublishConflict or VersionNotFound otherwise."""

    @abc.abstractmethod
    def _delete_version(self, name: str, version: int) -> bool:
        """Deletes a stored version unless the pointer names it, atomically with that check
        (against `_compare_and_set`); True if it deleted it. A reader never sees half of it."""

    @abc.abstractmethod
    def _write_held(self, replica_id: str, report: bytes, ttl_s: float) -> None:
        """Stores a replica's report, replacing its last one, to expire after `ttl_s` seconds."""

    @abc.abstractmethod
    def _read_held(self) -> list[bytes]:
        """Every unexpired report (expired ones may be removed on the way)."""

    def _not_found(self, name: str, version: int, more: str = "") -> VersionNotFound:
        return VersionNotFound(f"{self.codec.kind} {name!r} has no version {version}{more}")

    # The API.

    def publish(
        self,
        name: str,
        artefact: A,
        *,
        expected_current: int | None,
        parent_version: int | None = None,
        **meta: Any,
    ) -> M:
        """Stores `artefact` as a new immutable version of `name` and makes it current.

        Args:
            name: letters, digits, `_`, `-`, `.`; at most 64 characters.
            artefact: what the codec encodes (LoRA tensors, a routing model).
            expected_current: the version the caller believes is current (None: no version yet);
                the pointer only moves if it still names it.
            parent_version: the version this one was trained from; defaults to
                `expected_current` (none when that is `BASE_VERSION`).
            meta: the codec's further manifest fields (an adapter's `spec` and
                `acceptance_estimate`, a routing model's `score`).

        Returns:
            The manifest of the new, now current, version.

        Raises:
            PublishConflict: the pointer had moved; the new version is stored but not current.
            StoreUnavailable: the store could not be reached; the version may be stored, and
                (rarely: the reply was lost) may even be current.
            VersionTooLarge: payload over `max_bytes`.
            VersionIntegrityError, ValueError: the codec refused the artefact.
        """
        check_name(name, self.codec.kind)
        if expected_current is not None:
            check_version("expected_current", expected_current, base=True)
        if parent_version is None and expected_current != BASE_VERSION:
            parent_version = expected_current  # published over the base: no parent
        payload = self.codec.encode(artefact, **meta)
        if len(payload) > self.max_bytes:
            raise VersionTooLarge(
                f"{self.codec.kind} {name!r}: {len(payload)} bytes, over max_bytes {self.max_bytes}"
            )
        new = NewVersion(name, self._allocate_version(name), payload, time.time(), parent_version)
        manifest = self.codec.manifest(new, **meta)
        self._write_version(manifest, payload)
        self._compare_and_set(name, expected_current, manifest.version)
        return manifest

    def manifest(self, name: str, version: int) -> M:
        """The parsed, checked manifest of a stored version.

        Raises:
            VersionNotFound: no complete version `version` of `name`.
            VersionIntegrityError: the manifest is malformed or describes another version.
        """
        check_name(name, self.codec.kind)
        check_version("version", version)
        raw = self._read_manifest(name, version)
        if raw is None:
            raise self._not_found(name, version)
        try:
            manifest = self.codec.parse_manifest(raw)
        except ValueError as exc:
            raise VersionIntegrityError(
                f"{name} v{version}: bad manifest: {exc}", "bad_manifest"
            ) from exc
        if (manifest.name, manifest.version) != (name, version):
            raise VersionIntegrityError(
                f"{name} v{version}: the manifest stored there describes {manifest.ref}",
                "bad_manifest",
            )
        return manifest

    def load(self, name: str, version: int, **expected: Any) -> tuple[M, A]:
        """Reads and checks one version: manifest, size, then the codec's checks.

        Args:
            name, version: which version.
            expected: what the codec checks besides the bytes (an adapter's
                `expected_base_model_hash` and `expected_shapes`; see its `decode`).

        Returns:
            `(manifest, artefact)`.

        Raises:
            VersionNotFound, VersionIntegrityError, VersionTooLarge.
        """
        manifest = self.manifest(name, version)
        if manifest.num_bytes > self.max_bytes:
            raise VersionTooLarge(
                f"{manifest.ref}: {manifest.num_bytes} bytes, over max_bytes {self.max_bytes}"
            )
        payload = self._read_payload(name, version)
        if payload is None:
            if self._read_manifest(name, version) is None:  # deleted meanwhile
                raise self._not_found(name, version, " any more")
            raise VersionIntegrityError(
                f"{manifest.ref}: manifest present but payload missing", "weights_missing"
            )
        return manifest, self.codec.decode(manifest, payload, **expected)

    def rollback(self, name: str, to_version: int, *, expected_current: int | None) -> None:
        """Points `name` back at an earlier (or any stored) version, with compare-and-set.

        Raises:
            VersionNotFound: `to_version` is not a stored version of `name`.
            PublishConflict: the pointer did not name `expected_current`.
        `BASE_VERSION` (0) points it at the artefact's base (the base draft, no routing model):
        a rollback past the first published version, so that replicas started later and the
        trainer (whose next publish then conflicts) leave the rolled-back version too.
        """
        if to_version == BASE_VERSION:
            check_name(name, self.codec.kind)
        else:
            self.manifest(name, to_version)
        if expected_current is not None:
            check_version("expected_current", expected_current, base=True)
        self._compare_and_set(name, expected_current, to_version)

    def report_held(
        self, replica_id: str, held: Mapping[str, Iterable[int]], *, ttl_s: float
    ) -> None:
        """Tells `collect_garbage` which versions a replica holds (name -> versions),
        for `ttl_s` seconds; replicas repeat it every reconcile interval."""
        check_replica_id(replica_id)
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._write_held(replica_id, encode_held(held, ttl_s), ttl_s)

    def held_versions(self, name: str) -> set[int]:
        """The versions of `name` that some replica's unexpired report names."""
        check_name(name, self.codec.kind)
        return set(held_by_any(self._read_held(), name))

    def collect_garbage(self, name: str, *, keep_versions: int, grace_s: float) -> list[int]:
        """Deletes the versions of `name` that are not current, not among the `keep_versions`
        newest predecessors, held by no replica, and were published over `grace_s` ago.

        Cheap when there is nothing to delete: a listing, the pointer, and one manifest read
        per version outside the kept history.

        Returns:
            The versions deleted, ascending.

        Raises:
            StoreUnavailable, StoreError: the store failed; what was deleted
                before stays deleted.
        """
        if not (math.isfinite(grace_s) and grace_s >= 0):
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        candidates = unkept_versions(self.list_versions(name), self.current(name), keep_versions)
        if not candidates:
            return []
        held = self.held_versions(name)
        cutoff = time.time() - grace_s
        deleted = []
        for version in candidates:
            if version in held or not self._published_before(name, version, cutoff):
                continue
            if self._delete_version(name, version):
                deleted.append(version)
        return deleted

    def _published_before(self, name: str, version: int, cutoff: float) -> bool:
        try:
            return self.manifest(name, version).created_at < cutoff
        except VersionNotFound:
            return False  # deleted already
        except VersionIntegrityError:
            return True  # never loads anyway: nothing to protect

    def changed_pointers(self, known: Mapping[str, int | None]) -> list[PointerEvent]:
        """Reconciliation: an event per adapter name whose pointer differs from `known`.

        Replicas call this periodically with the versions they run, since notifications can be
        lost; names missing from `known` count as "no version yet".
        """
        events = []
        for name in sorted(set(self.names()) | set(known)):
            version = self.current(name)
            if version != known.get(name):
                events.append(PointerEvent(name=name, version=version))
        return events
