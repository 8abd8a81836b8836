"""The manifest of one adapter version: what the LoRA codec (`osd.adapters.codec`) writes
beside the weights in the versioned store (`osd.versions`).

docs/design.md, "Adapter version": name, version, base draft model id and hash, rank, target
modules, sha256 of the weights, creation time and the acceptance estimate that justified it; here
also lora_alpha (the scaling a replica needs to apply the weights), the weights' size (so a
truncated file is named as such), the parent version and a format version.

Pure: the standard library only. JSON in and out, unknown or missing keys rejected.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from osd.versions.codec import manifest_fields
from osd.versions.errors import check_name, check_number, check_sha256, check_version

__all__ = ["MANIFEST_FORMAT_VERSION", "AdapterManifest", "AdapterSpec"]

MANIFEST_FORMAT_VERSION = 1


def _normalize_targets(value: Any) -> tuple[str, ...] | str:
    """peft's target_modules: a collection of module names (sorted here) or one regex string."""
    if isinstance(value, str):
        if not value:
            raise ValueError("target_modules must not be empty")
        return value
    if (
        isinstance(value, list | tuple | set | frozenset)
        and value
        and all(isinstance(v, str) and v for v in value)
    ):
        return tuple(sorted(set(value)))
    raise ValueError(f"target_modules must be module names or a regex, got {value!r:.80}")


@dataclass(frozen=True)
class AdapterSpec:
    """What a version's weights belong to; the same for every version of an adapter.

    Attributes:
        base_model_id: hub id or path of the base draft model (informative).
        base_model_hash: `osd.adapters.lora.base_model_hash` of the base draft (checked on load).
        rank: LoRA rank r.
        lora_alpha: LoRA alpha (the update is scaled by lora_alpha / r).
        target_modules: peft target modules, module names (sorted tuple) or one regex.
    """

    base_model_id: str
    base_model_hash: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str

    def __post_init__(self) -> None:
        if not isinstance(self.base_model_id, str) or not self.base_model_id.strip():
            raise ValueError(f"base_model_id must be a non-empty str, got {self.base_model_id!r}")
        if len(self.base_model_id) > 512 or not self.base_model_id.isprintable():
            raise ValueError(
                f"base_model_id must be printable and <= 512 chars, got {self.base_model_id!r:.80}"
            )
        check_sha256("base_model_hash", self.base_model_hash)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {self.rank!r}")
        check_number("lora_alpha", self.lora_alpha, low=1e-12)
        object.__setattr__(self, "target_modules", _normalize_targets(self.target_modules))


@dataclass(frozen=True)
class AdapterManifest:
    """The manifest of one immutable adapter version (fields as in the module docstring).

    Attributes:
        name: adapter name, e.g. "general" or a domain.
        version: version number, >= 1, increasing in publish order.
        base_model_id, base_model_hash, rank, lora_alpha, target_modules: see `AdapterSpec`.
        weights_sha256: sha256 of the safetensors bytes, lowercase hex.
        num_weight_bytes: length of the safetensors bytes.
        created_at: publish time, Unix seconds.
        acceptance_estimate: held-out acceptance estimate that justified it, or None.
        parent_version: the version it was trained from / published over, or None.
        format_version: manifest schema version.
    """

    name: str
    version: int
    base_model_id: str
    base_model_hash: str
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    weights_sha256: str
    num_weight_bytes: int
    created_at: float
    acceptance_estimate: float | None
    parent_version: int | None
    format_version: int = MANIFEST_FORMAT_VERSION

    def __post_init__(self) -> None:
        check_name(self.name, "adapter")
        check_version("version", self.version)
        spec = self.spec  # validates the fields shared with AdapterSpec
        object.__setattr__(self, "target_modules", spec.target_modules)
        check_sha256("weights_sha256", self.weights_sha256)
        check_version("num_weight_bytes", self.num_weight_bytes)
        check_number("created_at", self.created_at, low=0.0)
        if self.acceptance_estimate is not None:
            check_number("acceptance_estimate", self.acceptance_estimate, low=0.0, high=1.0)
        if self.parent_version is not None:
            check_version("parent_version", self.parent_version)
        if self.format_version != MANIFEST_FORMAT_VERSION:
            raise ValueError(
                f"manifest format_version {self.format_version!r} is not supported "
                f"(this osd reads {MANIFEST_FORMAT_VERSION})"
            )

    @classmethod
    def create(cls, *, name: str, version: int, spec: AdapterSpec, **rest: Any) -> AdapterManifest:
        """A manifest from an `AdapterSpec` plus the per-version fields."""
        return cls(name=name, version=version, **asdict(spec), **rest)

    @property
    def spec(self) -> AdapterSpec:
        """The base-model and LoRA fields, as an `AdapterSpec`."""
        return AdapterSpec(
            base_model_id=self.base_model_id,
            base_model_hash=self.base_model_hash,
            rank=self.rank,
            lora_alpha=self.lora_alpha,
            target_modules=self.target_modules,
        )

    @property
    def num_bytes(self) -> int:
        """The weights' size (the store's name for a payload's size)."""
        return self.num_weight_bytes

    @property
    def ref(self) -> str:
        """``name vN``, for messages."""
        return f"{self.name} v{self.version}"

    def to_json(self) -> bytes:
        """UTF-8 JSON, keys sorted."""
        data = asdict(self)
        if isinstance(self.target_modules, tuple):
            data["target_modules"] = list(self.target_modules)
        return json.dumps(data, sort_keys=True, indent=1).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes | str) -> AdapterManifest:
        """Parses and validates a manifest.

        Raises:
            ValueError: not JSON, not an object, unknown or missing keys, or a bad value.
        """
        return cls(**manifest_fields(raw, [f.name for f in fields(cls)]))
