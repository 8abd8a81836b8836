"""The draft adapters' codec for the versioned store: LoRA tensors as safetensors bytes, an
`AdapterManifest` beside them.

`osd.versions` keeps versions of any artefact; this is what makes one an adapter: the weights
are checked on the way in (finite, LoRA A/B tensors of the spec's rank) and on the way out
(size, sha256, safetensors, the base draft's hash, and the shapes the replica's layout needs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

from torch import Tensor

from osd.adapters.lora import decode_weights, encode_weights
from osd.adapters.manifest import AdapterManifest, AdapterSpec
from osd.versions.codec import NewVersion
from osd.versions.errors import VersionIntegrityError
from osd.versions.store import VersionedStore

__all__ = ["LORA_CODEC", "AdapterStore", "LoraCodec"]

AdapterStore: TypeAlias = VersionedStore[dict[str, Tensor], AdapterManifest]
"""A versioned store holding LoRA adapters (`LORA_CODEC`)."""


class LoraCodec:
    """LoRA weights (keys as `osd.adapters.lora.lora_state_dict` gives them) and their manifest.

    `publish` takes `spec` (an `AdapterSpec`) and optionally `acceptance_estimate`; `load`
    takes `expected_base_model_hash` (None skips the check: tests and tools only) and
    optionally `expected_shapes` (key -> shape, `osd.adapters.lora.lora_shapes`).
    """

    kind = "adapter"
    payload_file = "adapter.safetensors"
    payload_key = "weights"

    def encode(self, artefact: Mapping[str, Tensor], **meta: Any) -> bytes:
        return encode_weights(artefact, _spec(meta).rank)

    def manifest(self, new: NewVersion, **meta: Any) -> AdapterManifest:
        return AdapterManifest.create(
            name=new.name,
            version=new.version,
            spec=_spec(meta),
            weights_sha256=new.sha256,
            num_weight_bytes=new.num_bytes,
            created_at=new.created_at,
            acceptance_estimate=meta.get("acceptance_estimate"),
            parent_version=new.parent_version,
        )

    def parse_manifest(self, raw: bytes) -> AdapterManifest:
        return AdapterManifest.from_json(raw)

    def decode(
        self, manifest: AdapterManifest, payload: bytes, **expected: Any
    ) -> dict[str, Tensor]:
        unknown = set(expected) - {"expected_base_model_hash", "expected_shapes"}
        if unknown or "expected_base_model_hash" not in expected:
            raise TypeError(
                "an adapter is loaded with expected_base_model_hash (None: unchecked) and "
                f"optionally expected_shapes, got {sorted(expected)}"
            )
        expected_base_model_hash: str | None = expected["expected_base_model_hash"]
        expected_shapes: Mapping[str, Sequence[int]] | None = expected.get("expected_shapes")
        if expected_base_model_hash is not None and (
            manifest.base_model_hash != expected_base_model_hash
        ):
            raise VersionIntegrityError(
                f"{manifest.ref} was trained on base model {manifest.base_model_id!r} with hash "
                f"{manifest.base_model_hash}, not this base model ({expected_base_model_hash})",
                "base_model_mismatch",
            )
        return decode_weights(manifest, payload, expected_shapes)


def _spec(meta: Mapping[str, Any]) -> AdapterSpec:
    unknown = set(meta) - {"spec", "acceptance_estimate"}
    if unknown:
        raise TypeError(f"an adapter version takes spec and acceptance_estimate, not {unknown}")
    spec = meta.get("spec")
    if not isinstance(spec, AdapterSpec):
        raise TypeError(f"an adapter version needs spec=AdapterSpec(...), got {spec!r:.80}")
    return spec


LORA_CODEC = LoraCodec()
