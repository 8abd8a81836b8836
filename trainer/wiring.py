"""The trainer's explicit wiring: every part of a worker built from the config in one place, as
:func:`serving.replica.wire_replica` builds a replica's.

A worker's parts: the draft trainer (the base draft with its LoRA adapters and their current /
candidate slots), the adapter store and the publisher that writes versions to it, the log
reader (one consumer of the group), the routing trainer (content routing's model, with its own
store), the tracker (W&B or nothing) and the heartbeat. :class:`trainer.worker.TrainerWorker`
takes them as they are and builds nothing; :func:`wire_trainer` builds them, then resumes the
worker (published versions loaded, the group's pending entries claimed).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from osd.adapters import adapter_store_location, open_adapter_store
from osd.adapters.codec import AdapterStore
from osd.buffer.reader import LogReader
from osd.config import OSDConfig
from osd.routing.store import RoutingStats, open_routing_store, routing_model_name
from trainer.adapter_state import AdapterState, adapter_states
from trainer.data_parallel import DataParallel
from trainer.draft_trainer import DraftTrainer, build_draft_trainer
from trainer.heartbeat import Heartbeat
from trainer.publisher import Publisher
from trainer.routing import RoutingTrainer
from trainer.tracking import NullTracker, Tracker
from trainer.worker import TrainerWorker

__all__ = ["configured_publisher", "configured_routing", "wire_trainer"]


def wire_trainer(
    config: OSDConfig,
    redis_url: str,
    *,
    draft: Any = None,
    base_model_id: str | None = None,
    store: AdapterStore | None = None,
    tracker: Tracker | None = None,
    consumer: str | None = None,
    data_parallel: DataParallel | None = None,
) -> TrainerWorker:
    """Builds and resumes one trainer worker.

    Args:
        config: the deployment's config (`model`, `log`, `adapters`, `routing`, `trainer`).
        redis_url: the log buffer's Redis (and the adapter store's, for the redis store).
        draft: the base draft, already loaded; default: `osd.model_sources.load_draft`.
        base_model_id: manifests' name of the base draft (default: where it was loaded from).
        store: adapter store; default: the one `config.adapters` names.
        tracker: where round metrics go (default: nowhere; the CLI opens W&B).
        consumer: consumer name; default `trainer.consumer` or ``<hostname>-<pid>``.
        data_parallel: the group this worker leads when it trains on several devices.
    """
    cfg = config.trainer
    adapters = list(config.model.adapters)
    trainer = build_draft_trainer(config, adapters, draft, base_model_id, data_parallel)
    store = store or open_adapter_store(adapter_store_location(config, redis_url))
    states = adapter_states(cfg, adapters)  # one object per adapter, shared by the parts
    publisher = configured_publisher(config, store, trainer, states)
    routing = configured_routing(config, redis_url, trainer, publisher.versions)
    worker = TrainerWorker(
        config,
        trainer=trainer,
        store=store,
        publisher=publisher,
        reader=LogReader(redis_url, config.log.stream, cfg.group, consumer or cfg.consumer or None),
        routing=routing,
        tracker=tracker or NullTracker(),
        heartbeat=functools.partial(Heartbeat, redis_url, config.log.stream, cfg.group),
    )
    worker.resume()
    return worker


def configured_publisher(
    config: OSDConfig, store: AdapterStore, trainer: DraftTrainer, states: dict[str, AdapterState]
) -> Publisher:
    """A publisher of `trainer`'s candidates to `store`, with the configured retention."""
    retention = config.adapters
    return Publisher(
        store,
        trainer,
        states,
        keep_versions=retention.keep_versions,
        gc_grace_s=retention.gc_grace_s,
    )


def configured_routing(
    config: OSDConfig,
    redis_url: str,
    trainer: DraftTrainer,
    versions: Mapping[str, int | None],
) -> RoutingTrainer:
    """Content routing's trainer as configured: records scored under `trainer`'s current slots,
    models published to the log's Redis under the stream's name."""
    retention = config.adapters
    return RoutingTrainer(
        list(config.model.adapters),
        lambda adapter, records: trainer.record_acceptance(adapter, "current", records),
        versions,
        config.routing,
        open_routing_store(redis_url),
        name=routing_model_name(config.log.stream),
        stats=RoutingStats(redis_url, config.log.stream),
        keep_versions=retention.keep_versions,
        gc_grace_s=retention.gc_grace_s,
        min_records=2 * config.trainer.min_holdout_records,
    )
