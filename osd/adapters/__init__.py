"""Draft adapters: LoRA weights, their versions, and the stores that keep them.

Owns: attaching and extracting LoRA weights and their safetensors codec (``lora``), a version's
manifest and the store's errors (``manifest``), which versions a store may delete
(``retention``), the store contract (``store``) and its two backends, a shared directory
(``store_dir``) and Redis (``store_redis``). The factory lives here, above the backends, so the
contract and its backends never import each other. May import torch, peft, safetensors and Redis;
never serving, the trainer or the decode loop. The trainer publishes here; replicas follow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from osd.adapters.store import AdapterStore

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
    """A `RedisAdapterStore` for a ``redis://``/``rediss://``/``unix://`` URL, else a
    `DirectoryAdapterStore` rooted at the path; `kwargs` go to the constructor."""
    text = str(location)
    if text.startswith(("redis://", "rediss://", "unix://")):
        from osd.adapters.store_redis import RedisAdapterStore

        return RedisAdapterStore(text, **kwargs)
    from osd.adapters.store_dir import DirectoryAdapterStore

    return DirectoryAdapterStore(text, **kwargs)
