"""Draft adapters: LoRA weights, their versions, and the stores that keep them.

Owns: attaching and extracting LoRA weights (``lora``), a version's manifest (``manifest``) and
the codec that makes adapters an artefact of the versioned store (``codec``, over
``osd.versions``, which keeps versions, pointers and retention for every artefact). May import
torch, peft, safetensors and ``osd.versions``; never serving, the trainer or the decode loop.
The trainer publishes here; replicas follow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from osd.adapters.codec import LORA_CODEC, AdapterStore
from osd.versions import open_store

__all__ = ["adapter_store_location", "open_adapter_store"]


def adapter_store_location(config: Any, redis_url: str) -> str:
    """Where `config.adapters` puts the store: the Redis URL, or `adapters.root` (default
    ``<run_dir>/adapters``) for the directory store. The trainer publishes there and the
    replicas' watchers follow it; both ask this function, so they cannot disagree."""
    if config.adapters.store == "redis":
        if not redis_url:
            raise ValueError("adapters.store is redis but no Redis URL was given")
        return redis_url
    return config.adapters.root or str(Path(config.run_dir) / "adapters")


def open_adapter_store(location: str | Path, **kwargs: Any) -> AdapterStore:
    """The adapters' store (`LORA_CODEC`): a `RedisStore` under namespace ``adapter`` for a
    ``redis://``/``rediss://``/``unix://`` URL, else a `DirectoryStore` rooted at the path;
    `kwargs` go to the constructor (`max_bytes`, `poll_interval_s`, `socket_timeout_s`)."""
    return open_store(location, LORA_CODEC, namespace="adapter", **kwargs)
