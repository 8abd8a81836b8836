"""The versioned store's names, events and errors, whatever the artefact.

One versioned store (`osd.versions.store`) keeps the draft adapters and the content router's
model alike; what a version holds is its codec's business (`osd.versions.codec`). This module is
what every artefact shares: the name and version rules, the pointer event, and the errors, each
saying whether a retry can help.

Pure: the standard library only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "BASE_VERSION",
    "PointerEvent",
    "PublishConflict",
    "RefusalReason",
    "StoreError",
    "StoreUnavailable",
    "VersionIntegrityError",
    "VersionNotFound",
    "VersionTooLarge",
    "check_name",
    "check_number",
    "check_sha256",
    "check_version",
]

# What a pointer names after a rollback past the first published version: the artefact's base
# (the base draft without LoRA weights; no routing model). Never a stored version; stored
# versions start at 1.
BASE_VERSION = 0

# Safe as a directory name, a Redis key part (no ':') and a JSON string.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class StoreError(RuntimeError):
    """Base of the versioned store's errors; also raised for backend I/O failures."""


class StoreUnavailable(StoreError):
    """The store could not be reached (Redis down, restarting or timing out; a full or flaky
    disk). Nothing is known about the outcome of a write that raised it: retry later, after
    re-reading `current`."""


class PublishConflict(StoreError):
    """The pointer did not name `expected` when it was to be moved: another publisher (or a
    rollback) got there first. Re-read `current`, then decide whether to publish again."""

    def __init__(self, name: str, expected: int | None, actual: int | None, new: int) -> None:
        super().__init__(
            f"{name!r}: pointer names version {actual}, not the expected {expected}; "
            f"version {new} was not made current"
        )
        self.name, self.expected, self.actual, self.new = name, expected, actual, new


class VersionNotFound(StoreError, LookupError):
    """No complete version with that name and number exists."""


# Why a version fails a check, as data (the `reason` of osd_adapter_refusals_total), so an
# operator can tell tampering (sha256, size, not safetensors) from a deployment mismatch (base
# model, LoRA layout) without anyone parsing messages.
RefusalReason = Literal[
    "sha256_mismatch",
    "size_mismatch",
    "not_safetensors",
    "non_finite",
    "not_lora",
    "not_a_routing_model",
    "base_model_mismatch",
    "shape_mismatch",
    "bad_manifest",
    "weights_missing",
    "too_large",
]


class VersionIntegrityError(StoreError, ValueError):
    """Stored bytes or manifest fail a check: tampered, truncated, not safetensors, made for
    another base model, or shaped for another layout; ``reason`` says which."""

    def __init__(self, message: str, reason: RefusalReason) -> None:
        super().__init__(message)
        self.reason: RefusalReason = reason


class VersionTooLarge(StoreError, ValueError):
    """The version's payload is over the store's `max_bytes`."""

    reason: RefusalReason = "too_large"


def check_name(name: Any, kind: str = "artefact") -> None:
    """Raises ValueError unless `name` is 1-64 of [A-Za-z0-9_.-], starting alphanumeric;
    the message calls it the `kind`'s name ("adapter name")."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"{kind} name must be 1-64 characters of [A-Za-z0-9_.-] starting with a letter or "
            f"digit, got {name!r:.80}"
        )


def check_version(field: str, value: Any, *, base: bool = False) -> None:
    """Raises ValueError unless `value` is an int >= 1 (or `BASE_VERSION`, with `base`)."""
    least = BASE_VERSION if base else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{field} must be an int >= {least}, got {value!r:.80}")


def check_sha256(field: str, value: Any) -> None:
    """Raises ValueError unless `value` is 64 lowercase hex digits."""
    if not isinstance(value, str) or not _SHA256_RE.fullmatch(value):
        raise ValueError(f"{field} must be 64 lowercase hex digits, got {value!r:.80}")


def check_number(field: str, value: Any, low: float, high: float = math.inf) -> None:
    """Raises ValueError unless `value` is a finite number in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{field} must be a number, got {value!r:.80}")
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{field} must be finite and in [{low}, {high}], got {value}")


@dataclass(frozen=True)
class PointerEvent:
    """A pointer move: artefact `name` now names `version` (None: no version)."""

    name: str
    version: int | None
