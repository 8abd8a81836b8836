"""Versioned LoRA adapters: immutable versions, one compare-and-set pointer per name, notifications.

docs/design.md, "Adapter version": a version is immutable once published (LoRA weights as
safetensors plus an `AdapterManifest`); a single pointer per adapter name says which version is
current; a notification tells replicas to look, and replicas also reconcile against the pointer
(`AdapterStore.changed_pointers`), since notifications can be lost.

Publishing is three steps, in this order, so a crash never exposes a half-written version:

1. allocate a fresh version number (monotonic, never reused; a crash may leave gaps);
2. write weights and manifest atomically (a backend's temp dir + rename, or one Redis
   transaction); a version that exists is complete, and is never written again;
3. move the pointer with compare-and-set against the version the publisher last saw
   (`expected_current`), then notify. A publisher that lost the race gets `PublishConflict`; its
   version stays stored but is not current.

`load` trusts nothing it reads: it checks size, sha256, that the bytes are a safetensors file
(never pickle; `torch.load` is not used anywhere), the base model hash, the rank, and the shapes
the caller expects. History is bounded: `collect_garbage` deletes versions no rollback or replica
needs any more (the rules are in `osd.adapters.retention`; replicas name what they hold with
`report_held`). Backends: `osd.adapters.store_dir.DirectoryAdapterStore` (shared filesystem)
and `osd.adapters.store_redis.RedisAdapterStore`; `osd.adapters.open_adapter_store` picks one
by location.
Peft and base-model helpers live in `osd.adapters.lora`.
"""

from __future__ import annotations

import abc
import hashlib
import math
import time
from collections.abc import Iterable, Mapping, Sequence

from torch import Tensor

from osd.adapters.lora import decode_weights, encode_weights
from osd.adapters.manifest import (
    BASE_VERSION,
    AdapterEvent,
    AdapterIntegrityError,
    AdapterManifest,
    AdapterNotFound,
    AdapterSpec,
    AdapterStoreError,
    AdapterStoreUnavailable,
    AdapterTooLarge,
    PublishConflict,
    check_adapter_name,
    check_version,
)
from osd.adapters.retention import check_replica_id, encode_held, held_by_any, unkept_versions
from osd.closing import Closeable

__all__ = [
    "BASE_VERSION",
    "DEFAULT_MAX_BYTES",
    "AdapterEvent",
    "AdapterIntegrityError",
    "AdapterManifest",
    "AdapterNotFound",
    "AdapterSpec",
    "AdapterStore",
    "AdapterStoreError",
    "AdapterStoreUnavailable",
    "AdapterSubscription",
    "AdapterTooLarge",
    "PublishConflict",
]

DEFAULT_MAX_BYTES = 256 * 2**20


class AdapterSubscription(Closeable, abc.ABC):
    """Notifications of pointer moves; use as a context manager, or call `close`."""

    @abc.abstractmethod
    def get(self, timeout_s: float) -> AdapterEvent | None:
        """The next event, or None if none came within `timeout_s` seconds."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops listening and frees the connection, if any."""


class AdapterStore(abc.ABC):
    """Immutable adapter versions plus a compare-and-set pointer per name.

    Backends implement the storage primitives (the abstract methods); publishing, loading and
    their checks live here, once.

    Args:
        max_bytes: largest weights file accepted by `publish` and `load`.
    """

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.max_bytes = max_bytes

    # Storage primitives.

    @abc.abstractmethod
    def current(self, name: str) -> int | None:
        """The version the pointer of `name` names, or None if none was ever published
        (`BASE_VERSION`, 0: rolled back to the base draft)."""

    @abc.abstractmethod
    def list_versions(self, name: str) -> list[int]:
        """All complete versions of `name`, ascending (current or not)."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """All adapter names with at least one stored version, sorted."""

    @abc.abstractmethod
    def subscribe(self) -> AdapterSubscription:
        """Starts listening for pointer moves of every adapter name."""

    @abc.abstractmethod
    def _allocate_version(self, name: str) -> int:
        """A version number of `name` never handed out before, larger than all earlier ones."""

    @abc.abstractmethod
    def _write_version(self, manifest: AdapterManifest, payload: bytes) -> None:
        """Stores weights and manifest so that both or neither become visible."""

    @abc.abstractmethod
    def _read_manifest(self, name: str, version: int) -> bytes | None:
        """The manifest bytes of a complete version, or None."""

    @abc.abstractmethod
    def _read_weights(self, name: str, version: int) -> bytes | None:
        """The weights bytes of a version, or None."""

    @abc.abstractmethod
    def _compare_and_set(self, name: str, expected: int | None, new: int) -> None:
        """Atomically: if the pointer names `expected` and version `new` is complete, point at
        `new` and notify; raises PublishConflict or AdapterNotFound otherwise."""

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

    # The API.

    def publish(
        self,
        name: str,
        weights: Mapping[str, Tensor],
        spec: AdapterSpec,
        *,
        expected_current: int | None,
        acceptance_estimate: float | None = None,
        parent_version: int | None = None,
    ) -> AdapterManifest:
        """Stores `weights` as a new immutable version of `name` and makes it current.

        Args:
            name: adapter name (letters, digits, `_`, `-`, `.`; at most 64 characters).
            weights: LoRA tensors as `osd.adapters.lora.lora_state_dict` returns them.
            spec: base model and LoRA configuration the weights belong to.
            expected_current: the version the caller believes is current (None: no version yet);
                the pointer only moves if it still names it.
            acceptance_estimate: the held-out acceptance estimate that justified publishing.
            parent_version: the version these weights were trained from; defaults to
                `expected_current`.

        Returns:
            The manifest of the new, now current, version.

        Raises:
            PublishConflict: the pointer had moved; the new version is stored but not current.
            AdapterStoreUnavailable: the store could not be reached; the version may be stored,
                and (rarely: the reply was lost) may even be current.
            AdapterTooLarge: weights over `max_bytes`.
            AdapterIntegrityError: weights empty, non-finite, or not of rank `spec.rank`.
        """
        check_adapter_name(name)
        if expected_current is not None:
            check_version("expected_current", expected_current, base=True)
        if parent_version is None and expected_current != BASE_VERSION:
            parent_version = expected_current  # trained from the base draft: no parent
        payload = encode_weights(weights, spec.rank)
        if len(payload) > self.max_bytes:
            raise AdapterTooLarge(
                f"adapter {name!r}: {len(payload)} bytes of weights, over max_bytes "
                f"{self.max_bytes}"
            )
        manifest = AdapterManifest.create(
            name=name,
            version=self._allocate_version(name),
            spec=spec,
            weights_sha256=hashlib.sha256(payload).hexdigest(),
            num_weight_bytes=len(payload),
            created_at=time.time(),
            acceptance_estimate=acceptance_estimate,
            parent_version=parent_version,
        )
        self._write_version(manifest, payload)
        self._compare_and_set(name, expected_current, manifest.version)
        return manifest

    def manifest(self, name: str, version: int) -> AdapterManifest:
        """The parsed, checked manifest of a stored version.

        Raises:
            AdapterNotFound: no complete version `version` of `name`.
            AdapterIntegrityError: the manifest is malformed or describes another version.
        """
        check_adapter_name(name)
        check_version("version", version)
        raw = self._read_manifest(name, version)
        if raw is None:
            raise AdapterNotFound(f"adapter {name!r} has no version {version}")
        try:
            manifest = AdapterManifest.from_json(raw)
        except ValueError as exc:
            raise AdapterIntegrityError(
                f"{name} v{version}: bad manifest: {exc}", "bad_manifest"
            ) from exc
        if (manifest.name, manifest.version) != (name, version):
            raise AdapterIntegrityError(
                f"{name} v{version}: the manifest stored there describes {manifest.ref}",
                "bad_manifest",
            )
        return manifest

    def load(
        self,
        name: str,
        version: int,
        *,
        expected_base_model_hash: str | None,
        expected_shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> tuple[AdapterManifest, dict[str, Tensor]]:
        """Reads and checks one version: manifest, size, sha256, safetensors, rank, shapes.

        Args:
            name, version: which adapter version.
            expected_base_model_hash: `osd.adapters.lora.base_model_hash` of the caller's base
                draft; None skips the check (tests and tools only).
            expected_shapes: key -> shape the weights must match exactly, e.g.
                `osd.adapters.lora.lora_shapes(peft_model, adapter_name)`; None skips it.

        Returns:
            `(manifest, weights)`, weights as CPU tensors keyed like `lora_state_dict`.

        Raises:
            AdapterNotFound, AdapterIntegrityError, AdapterTooLarge.
        """
        manifest = self.manifest(name, version)
        if expected_base_model_hash is not None and (
            manifest.base_model_hash != expected_base_model_hash
        ):
            raise AdapterIntegrityError(
                f"{manifest.ref} was trained on base model {manifest.base_model_id!r} with hash "
                f"{manifest.base_model_hash}, not this base model ({expected_base_model_hash})",
                "base_model_mismatch",
            )
        if manifest.num_weight_bytes > self.max_bytes:
            raise AdapterTooLarge(
                f"{manifest.ref}: {manifest.num_weight_bytes} bytes of weights, over max_bytes "
                f"{self.max_bytes}"
            )
        payload = self._read_weights(name, version)
        if payload is None:
            if self._read_manifest(name, version) is None:  # deleted meanwhile
                raise AdapterNotFound(f"adapter {name!r} has no version {version} any more")
            raise AdapterIntegrityError(
                f"{manifest.ref}: manifest present but weights missing", "weights_missing"
            )
        return manifest, decode_weights(manifest, payload, expected_shapes)

    def rollback(self, name: str, to_version: int, *, expected_current: int | None) -> None:
        """Points `name` back at an earlier (or any stored) version, with compare-and-set.

        Raises:
            AdapterNotFound: `to_version` is not a stored version of `name`.
            PublishConflict: the pointer did not name `expected_current`.
        `BASE_VERSION` (0) points it at the base draft itself: a rollback past the first
        published version, so that replicas started later and the trainer (whose next publish
        then conflicts) leave the rolled-back version too.
        """
        if to_version == BASE_VERSION:
            check_adapter_name(name)
        else:
            self.manifest(name, to_version)
        if expected_current is not None:
            check_version("expected_current", expected_current, base=True)
        self._compare_and_set(name, expected_current, to_version)

    def report_held(
        self, replica_id: str, held: Mapping[str, Iterable[int]], *, ttl_s: float
    ) -> None:
        """Tells `collect_garbage` which versions a replica holds (adapter name -> versions),
        for `ttl_s` seconds; replicas repeat it every reconcile interval."""
        check_replica_id(replica_id)
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._write_held(replica_id, encode_held(held, ttl_s), ttl_s)

    def held_versions(self, name: str) -> set[int]:
        """The versions of `name` that some replica's unexpired report names."""
        check_adapter_name(name)
        return set(held_by_any(self._read_held(), name))

    def collect_garbage(self, name: str, *, keep_versions: int, grace_s: float) -> list[int]:
        """Deletes the versions of `name` that are not current, not among the `keep_versions`
        newest predecessors, held by no replica, and were published over `grace_s` ago.

        Cheap when there is nothing to delete: a listing, the pointer, and one manifest read
        per version outside the kept history.

        Returns:
            The versions deleted, ascending.

        Raises:
            AdapterStoreUnavailable, AdapterStoreError: the store failed; what was deleted
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
        except AdapterNotFound:
            return False  # deleted already
        except AdapterIntegrityError:
            return True  # never loads anyway: nothing to protect

    def changed_pointers(self, known: Mapping[str, int | None]) -> list[AdapterEvent]:
        """Reconciliation: an event per adapter name whose pointer differs from `known`.

        Replicas call this periodically with the versions they run, since notifications can be
        lost; names missing from `known` count as "no version yet".
        """
        events = []
        for name in sorted(set(self.names()) | set(known)):
            version = self.current(name)
            if version != known.get(name):
                events.append(AdapterEvent(name=name, version=version))
        return events
