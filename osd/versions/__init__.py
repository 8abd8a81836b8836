"""Versioned artefacts: one store for everything the trainer publishes and replicas follow.

Owns: the names, events and errors (``errors``), the codec contract (``codec``), which versions
a store may delete (``retention``), the store contract (``store``) and its two backends, a
shared directory (``store_dir``) and Redis (``store_redis``). The draft adapters
(``osd.adapters.codec``) and the content router's model (``osd.routing.store``) are its two
artefacts. The factory lives here, above the backends, so the contract and its backends never
import each other. May import Redis and the buffer's Redis helpers; never torch, serving, the
trainer or the decode loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from osd.versions.codec import Codec
from osd.versions.store import VersionedStore

__all__ = ["open_store"]


def open_store(
    location: str | Path, codec: Codec[Any, Any], *, namespace: str, **kwargs: Any
) -> VersionedStore[Any, Any]:
    """A `RedisStore` under `namespace` for a Redis URL, else a `DirectoryStore` rooted at the
    path; `kwargs` go to the constructor."""
    if str(location).startswith(("redis://", "rediss://", "unix://")):
        from osd.versions.store_redis import RedisStore

        return RedisStore(str(location), codec, namespace=namespace, **kwargs)
    from osd.versions.store_dir import DirectoryStore

    return DirectoryStore(location, codec, **kwargs)
