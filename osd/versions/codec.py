"""What the versioned store needs to know of an artefact: its codec.

The store (`osd.versions.store`) keeps bytes, a manifest beside them and a pointer; it never
looks inside either. A codec turns an artefact into those bytes and a manifest, and back, with
every check a reader must make before trusting what it read (size, sha256, format, and whatever
the artefact's users require, passed to `decode` as keyword arguments). Two codecs exist: LoRA
adapters (`osd.adapters.codec.LoraCodec`) and the content router's model
(`osd.routing.store.RoutingCodec`).

Pure: the standard library only.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from osd.versions.errors import VersionIntegrityError

__all__ = [
    "Codec",
    "Manifest",
    "NewVersion",
    "check_payload",
    "check_safetensors_frame",
    "manifest_fields",
]

_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on its JSON header


@dataclass(frozen=True)
class NewVersion:
    """What the store knows of a version it is about to write, for the codec's manifest."""

    name: str
    version: int
    payload: bytes
    created_at: float
    parent_version: int | None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()

    @property
    def num_bytes(self) -> int:
        return len(self.payload)


class Manifest(Protocol):
    """The fields the store reads from any manifest."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def created_at(self) -> float: ...

    @property
    def num_bytes(self) -> int: ...

    @property
    def ref(self) -> str: ...

    def to_json(self) -> bytes: ...


A = TypeVar("A")
M = TypeVar("M", bound=Manifest)


class Codec(Protocol[A, M]):
    """Bytes and manifest of one kind of artefact.

    Attributes:
        kind: what the artefact is, for messages ("adapter", "routing model").
        payload_file: the payload's file name in a directory store.
        payload_key: the payload's key suffix in a Redis store.
    """

    kind: str
    payload_file: str
    payload_key: str

    def encode(self, artefact: A, **meta: Any) -> bytes:
        """The payload bytes; raises ValueError (or a `VersionIntegrityError`) for an artefact
        that must not be published."""
        ...

    def manifest(self, new: NewVersion, **meta: Any) -> M:
        """The manifest of a new version; `meta` as given to `encode`."""
        ...

    def parse_manifest(self, raw: bytes) -> M:
        """Parses and validates stored manifest bytes; ValueError if they are not one."""
        ...

    def decode(self, manifest: M, payload: bytes, **expected: Any) -> A:
        """The artefact, after checking `payload` against `manifest` and `expected`; raises
        `VersionIntegrityError` naming the failed check."""
        ...


def check_payload(ref: str, payload: bytes, *, num_bytes: int, sha256: str) -> None:
    """Raises `VersionIntegrityError` unless `payload` has the size and sha256 its manifest
    (`ref`, for messages) gives: a truncated or tampered payload is named as such."""
    if len(payload) != num_bytes:
        what = "truncated" if len(payload) < num_bytes else "too long"
        raise VersionIntegrityError(
            f"{ref}: payload {what}: {len(payload)} bytes, manifest says {num_bytes}",
            "size_mismatch",
        )
    digest = hashlib.sha256(payload).hexdigest()
    if digest != sha256:
        raise VersionIntegrityError(
            f"{ref}: payload sha256 {digest} != manifest's {sha256}", "sha256_mismatch"
        )


def check_safetensors_frame(payload: bytes) -> None:
    """Refuses bytes that cannot be safetensors before a parser sees them (a pickle starts
    with 0x80, a safetensors file with an 8-byte header length and then '{')."""
    if len(payload) < 9:
        raise VersionIntegrityError(
            f"payload is not a safetensors file ({len(payload)} bytes)", "not_safetensors"
        )
    (header_len,) = struct.unpack("<Q", payload[:8])
    if header_len > min(len(payload) - 8, _MAX_HEADER_BYTES) or payload[8:9] != b"{":
        raise VersionIntegrityError(
            f"payload is not a safetensors file (starts with {payload[:12]!r}); refusing to "
            "load it (pickled weights are never accepted)",
            "not_safetensors",
        )


def manifest_fields(raw: bytes | str, names: Collection[str]) -> dict[str, Any]:
    """The fields of a JSON manifest that must have exactly the keys `names` (a manifest
    dataclass's fields); the caller's constructor checks the values.

    Raises:
        ValueError: not JSON, not an object, or unknown or missing keys.
    """
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"manifest is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"manifest must be a JSON object, got {type(data).__name__}")
    unknown, missing = sorted(set(data) - set(names)), sorted(set(names) - set(data))
    if unknown or missing:
        raise ValueError(f"manifest has unknown keys {unknown} and lacks keys {missing}")
    return data
