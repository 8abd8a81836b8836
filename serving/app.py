"""The Ray Serve application: replicas running :class:`ReplicaRuntime` behind the HTTP API.

``serve run configs/serve.yaml`` (import path ``serving.app:app_builder``) or
``osd serve --config ...``. Replica count, concurrency, queue bound and GPUs per replica come
from the config; Ray Serve answers 503 when a replica's queue is full.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray import serve

from osd.adapters import adapter_store_location, open_adapter_store
from osd.config import OSDConfig, config_from_dict, load_config
from osd.heap import freeze_startup_heap
from osd.threads import set_switch_interval
from serving.api import create_api
from serving.replica import wire_replica

__all__ = ["OSDReplica", "app_builder", "build_app"]

logger = logging.getLogger(__name__)


@serve.ingress()
class OSDReplica:
    """One replica: models, adapters, log writer and watcher, with the FastAPI app."""

    def __init__(self, config: dict[str, Any], redis_url: str = "") -> None:
        self.config: OSDConfig = config_from_dict(OSDConfig, config)
        # This process is the replica's: its decode thread and event loop share one GIL.
        set_switch_interval(self.config.serve.gil_switch_interval_ms)
        writer, store = None, None
        url = redis_url or self.config.log.redis_url
        if self.config.log.enabled and url:
            from osd.buffer.writer import LogWriter

            writer = LogWriter.from_config(url, self.config.log)
        if url:  # where the trainer publishes (osd.adapters.adapter_store_location)
            store = open_adapter_store(adapter_store_location(self.config, url))
        self.replica = wire_replica(self.config, log_writer=writer, store=store, redis_url=url)
        self.runtime, self.watcher = self.replica.runtime, self.replica.watcher
        # This process is the replica's: what it holds now lives as long as it does.
        logger.info("%d objects kept out of full garbage collections", freeze_startup_heap())

    def __serve_build_asgi_app__(self) -> Any:
        return create_api(self.runtime)

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose health check raises."""
        if self.watcher is not None and not self.watcher.alive:
            raise RuntimeError("adapter watcher thread died")

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.close()


def build_app(config: OSDConfig, redis_url: str = "") -> Any:
    """A bound Serve application for ``config``; ConfigError if it would serve without keys
    beyond loopback unasked (``ServeConfig.check_access``)."""
    s = config.serve
    s.check_access()
    deployment: Any = serve.deployment(
        OSDReplica,
        name="osd",
        num_replicas=s.num_replicas,
        max_ongoing_requests=s.max_ongoing_requests,
        max_queued_requests=s.max_queued_requests,
        ray_actor_options={"num_cpus": s.num_cpus, "num_gpus": s.num_gpus},
        health_check_period_s=5,
        # How often a stopping replica looks for requests still in flight (Ray's default 2 s):
        # an idle replica stopped up to that much later than it could, at every Ctrl-C and
        # scale-down. The drain itself is unchanged (graceful_shutdown_timeout_s).
        graceful_shutdown_wait_loop_s=0.25,
    )
    return deployment.bind(_as_dict(config), redis_url)


def app_builder(args: dict[str, Any]) -> Any:
    """Entry point for ``serve run``: ``args`` holds ``config`` (a path, or a built-in config's
    name; default ``demo``, the embedded local default), ``overrides`` and ``redis_url``
    (default: the ``REDIS_URL`` environment variable, else the config's)."""
    overrides = args.get("overrides") or []
    config = load_config(args.get("config") or "demo", list(overrides))
    return build_app(config, args.get("redis_url") or os.environ.get("REDIS_URL", ""))


def _as_dict(config: OSDConfig) -> dict[str, Any]:
    import dataclasses

    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return list(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(config))
