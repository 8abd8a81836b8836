"""The content router's model as an artefact of the versioned store, and its accuracy points.

The routing model is versioned exactly like the adapters (`osd.versions`): a version is immutable
once written, one pointer names the current one and moves only by compare-and-set (so a replica
that rolls a loser back and a trainer that publishes over it never both win), history is bounded
and never drops a version a replica reports holding, and a pointer move is published on a
channel. It lives in the log's Redis (every replica and the trainer reach it) under namespace
``router``, named after the log stream (`routing_model_name`: one model per stream, as the
records it is fitted on); `BASE_VERSION` (0) stands for "no model, route as before".

Its codec: the model's safetensors bytes (`RoutingModel.to_bytes`) and a `RoutingManifest`
(sha256, size, creation time, the held-out score that justified it, the parent version).

Beside the versions, the trainer appends routing-accuracy points to a capped list,
``<stream>:router:stats`` (`RoutingStats`), which the demo's report reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeAlias

import redis

from osd.buffer.redis_server import connect
from osd.routing.model import MAX_MODEL_BYTES, RoutingModel
from osd.versions.codec import (
    NewVersion,
    check_payload,
    check_safetensors_frame,
    manifest_fields,
)
from osd.versions.errors import (
    StoreUnavailable,
    VersionIntegrityError,
    check_name,
    check_number,
    check_sha256,
    check_version,
)
from osd.versions.store import VersionedStore
from osd.versions.store_redis import RedisStore

__all__ = [
    "ROUTING_CODEC",
    "RoutingCodec",
    "RoutingManifest",
    "RoutingStats",
    "RoutingStore",
    "open_routing_store",
    "routing_model_name",
]

MAX_STATS = 2000
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class RoutingManifest:
    """The manifest of one routing-model version.

    Attributes:
        name: `routing_model_name` of the log stream.
        version: >= 1.
        sha256, num_bytes: of the model's safetensors bytes.
        created_at: publish time, Unix seconds.
        score: the held-out routing score that justified publishing it, or None.
        parent_version: the version it was published over, or None.
        format_version: manifest schema version.
    """

    name: str
    version: int
    sha256: str
    num_bytes: int
    created_at: float
    score: float | None
    parent_version: int | None
    format_version: int = _FORMAT_VERSION

    def __post_init__(self) -> None:
        check_name(self.name, "routing model")
        check_version("version", self.version)
        check_sha256("sha256", self.sha256)
        check_version("num_bytes", self.num_bytes)
        check_number("created_at", self.created_at, low=0.0)
        if self.score is not None:
            check_number("score", self.score, low=-1e9, high=1e9)
        if self.parent_version is not None:
            check_version("parent_version", self.parent_version)
        if self.format_version != _FORMAT_VERSION:
            raise ValueError(f"routing manifest format_version {self.format_version!r} unknown")

    @property
    def ref(self) -> str:
        return f"{self.name} v{self.version}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> RoutingManifest:
        """Parses and validates; ValueError for anything else."""
        return cls(**manifest_fields(raw, [f.name for f in fields(cls)]))


class RoutingCodec:
    """`RoutingModel` <-> safetensors bytes; `publish` takes `score`, `load` nothing more."""

    kind = "routing model"
    payload_file = "router.safetensors"
    payload_key = "model"

    def encode(self, artefact: RoutingModel, **meta: Any) -> bytes:
        if set(meta) - {"score"}:
            raise TypeError(f"a routing model version takes score, not {sorted(meta)}")
        return artefact.to_bytes()

    def manifest(self, new: NewVersion, **meta: Any) -> RoutingManifest:
        score = meta.get("score")
        return RoutingManifest(
            name=new.name,
            version=new.version,
            sha256=new.sha256,
            num_bytes=new.num_bytes,
            created_at=new.created_at,
            score=None if score is None else float(score),
            parent_version=new.parent_version,
        )

    def parse_manifest(self, raw: bytes) -> RoutingManifest:
        return RoutingManifest.from_json(raw)

    def decode(self, manifest: RoutingManifest, payload: bytes, **expected: Any) -> RoutingModel:
        if expected:
            raise TypeError(f"a routing model is loaded without expectations, got {expected}")
        check_payload(manifest.ref, payload, num_bytes=manifest.num_bytes, sha256=manifest.sha256)
        check_safetensors_frame(payload)
        try:
            return RoutingModel.from_bytes(payload)
        except ValueError as exc:
            raise VersionIntegrityError(f"{manifest.ref}: {exc}", "not_a_routing_model") from exc


ROUTING_CODEC = RoutingCodec()

RoutingStore: TypeAlias = VersionedStore[RoutingModel, RoutingManifest]
"""A versioned store holding routing models (`ROUTING_CODEC`)."""


def routing_model_name(stream: str) -> str:
    """The routing model's name in the store for log stream `stream`: the stream's name made
    safe for a key part (``osd:log`` -> ``osd.log``)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", ".", stream).lstrip("._-")[:64]
    return name or "log"


def open_routing_store(redis_url: str) -> RoutingStore:
    """The routing model's versions in the log's Redis (namespace ``router``)."""
    return RedisStore(redis_url, ROUTING_CODEC, namespace="router", max_bytes=MAX_MODEL_BYTES)


class RoutingStats:
    """The trainer's routing-accuracy points: a capped JSON list in the log's Redis.

    Args:
        url: the log buffer's Redis URL.
        stream: the log stream's name (the key lives under it).
    """

    def __init__(self, url: str, stream: str) -> None:
        self._client = connect(url)
        self.key = f"{stream}:router:stats"

    def add(self, point: dict[str, Any]) -> None:
        """Appends one point, keeping the newest `MAX_STATS`.

        Raises:
            StoreUnavailable: Redis failed.
        """
        pipe = self._client.pipeline()
        pipe.rpush(self.key, json.dumps(point, sort_keys=True))
        pipe.ltrim(self.key, -MAX_STATS, -1)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"Redis failed while writing routing stats: {exc}") from exc

    def all(self) -> list[dict[str, Any]]:
        """Every kept point, oldest first.

        Raises:
            StoreUnavailable: Redis failed.
        """
        try:
            raw = self._client.lrange(self.key, 0, -1)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"Redis failed while reading routing stats: {exc}") from exc
        return [json.loads(item) for item in raw]

    def close(self) -> None:
        self._client.close()
