"""One replica, wired explicitly: every part built here and handed to the parts that use it.

The runtime (serving.runtime) receives its engine, batched loop, adapter slots, router, metrics,
log writer, live monitor, adapter-event sink and loop health probe; one version watcher
(serving.watcher) follows the adapter store with the slots as its holder
(serving.adapter_holder), another the routing model with the router's trial
(serving.router_trial), both appending to the event sink.
No part builds another or writes into another's fields, so a reader sees here what talks to
what. The Ray deployment (serving.app) and the Ray-free replicas of the tests both wire through
:func:`wire_replica`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from osd.adapters.codec import AdapterStore
from osd.config import OSDConfig, ServeConfig
from osd.decode.engine import SpeculativeDecoder
from osd.decode.loop import BatchedEngine
from osd.decode.scheduler import BatchLimits
from osd.decode.warmup import warm_up
from osd.device_memory import forward_peak_bytes, kv_budget_bytes
from osd.model_sources import attach_lora_adapters, load_model_pair
from osd.routing.store import open_routing_store, routing_model_name
from osd.threads import threads_for
from serving.adapter_holder import AdapterHolder
from serving.adapter_slots import AdapterSlots, peft_adapter_name
from serving.health import HealthLimits, LoopHealth
from serving.live_monitor import LiveMonitor
from serving.metrics import ReplicaMetrics
from serving.router import AdapterRouter
from serving.router_trial import RouterTrial
from serving.runtime import ReplicaRuntime
from serving.suffix_warmup import SuffixWarmup
from serving.watcher import VersionWatcher

__all__ = ["WiredReplica", "build_runtime", "wire_replica"]

logger = logging.getLogger(__name__)

# Adapter events (swaps, rollbacks, refusals) a replica keeps for /health.
RECENT_ADAPTER_EVENTS = 100


@dataclass
class ReplicaModels:
    """A replica's models: the target, the tokenizer, and the draft inside its adapter slots
    (every configured adapter at version 0, the base draft)."""

    target: Any
    tokenizer: Any
    slots: AdapterSlots


def load_replica_models(config: OSDConfig) -> ReplicaModels:
    target, draft, tokenizer = load_model_pair(config.model)
    adapters = list(config.model.adapters)
    draft = attach_lora_adapters(draft, config.model, [peft_adapter_name(a, 0) for a in adapters])
    return ReplicaModels(target, tokenizer, AdapterSlots(draft, adapters))


def _kv_memory(engine: SpeculativeDecoder, serve: ServeConfig) -> int:
    """The KV budget of ``serve.kv_cache_memory_bytes`` or ``serve.gpu_memory_utilization``."""
    if serve.kv_slots or serve.kv_cache_memory_bytes or not serve.gpu_memory_utilization:
        return serve.kv_cache_memory_bytes
    reserve = max(
        forward_peak_bytes(lm, serve.max_num_batched_tokens) for lm in (engine.target, engine.draft)
    )
    budget = kv_budget_bytes(engine.device, serve.gpu_memory_utilization, reserve)
    logger.info(
        "KV memory: %.1f MiB for the caches (%.0f%% of %s, %.1f MiB kept for activations)",
        budget / 2**20,
        100 * serve.gpu_memory_utilization,
        engine.device,
        reserve / 2**20,
    )
    return max(budget, 1)


def build_runtime(
    config: OSDConfig,
    models: ReplicaModels | None = None,
    *,
    metrics: ReplicaMetrics | None = None,
    log_writer: Any = None,
    monitor: LiveMonitor | None = None,
    events: deque[dict[str, Any]] | None = None,
    health: LoopHealth | None = None,
) -> ReplicaRuntime:
    """A runtime for `config` on `models` (loaded here unless given), its decode loop started;
    the other parts as :class:`serving.runtime.ReplicaRuntime` takes them."""
    models = models or load_replica_models(config)
    spec, serve = config.spec, config.serve
    engine = SpeculativeDecoder(
        models.target,
        models.slots.model,
        models.tokenizer,
        log_top_m=spec.log_top_m,
        adaptive_threshold=spec.adaptive_threshold,
        max_spec_tokens=spec.max_spec_tokens,
        lean_forward=config.model.lean_forward,
        compile_forward=config.model.compile,
        cuda_graphs=config.model.cuda_graphs,
        merged_drafts=config.model.merged_drafts,
        suffix_budget=spec.suffix_budget_tokens,
        suffix_scope=spec.suffix_scope,
        max_lookup_tokens=spec.max_lookup_tokens,
        # Adapters are added and removed between forwards, never during one.
        draft_guard=models.slots.model_lock.reading,
    )
    # The decode loop's threads: this replica's share of the cores it may use (osd.threads).
    threads = threads_for("replica", serve.torch_threads)
    logger.info(threads.describe())
    batch = BatchedEngine(
        engine,
        BatchLimits(
            max_num_seqs=serve.max_num_seqs,
            max_num_batched_tokens=serve.max_num_batched_tokens,
            kv_slots=serve.kv_slots,
            max_model_len=serve.max_model_len,
            max_waiting=serve.max_ongoing_requests,
            kv_cache_memory_bytes=_kv_memory(engine, serve),
            prefix_caching=serve.enable_prefix_caching,
        ),
        num_threads=threads.num_threads,
    )
    metrics = metrics or ReplicaMetrics(model_name=config.serve.model_name)
    if serve.warmup:  # before the replica reports ready: its first clients pay nothing
        report = warm_up(batch)
        logger.info(report.describe())
        metrics.warmup_seconds.set(report.seconds)
    adapters = list(config.model.adapters)
    return ReplicaRuntime(
        config,
        engine,
        batch,
        models.slots,
        AdapterRouter(adapters, general=adapters[0], min_confidence=config.routing.min_confidence),
        metrics,
        log_writer=log_writer,
        monitor=monitor,
        events=events,
        health=health,
    )


@dataclass
class WiredReplica:
    """A replica's running parts; ``close`` stops them, the probe and watcher first."""

    runtime: ReplicaRuntime
    watcher: VersionWatcher | None
    health: LoopHealth
    router_watcher: VersionWatcher | None = None
    suffix_warmup: SuffixWarmup | None = None

    def close(self) -> None:
        self.health.stop()
        if self.watcher is not None:
            self.watcher.stop()
        if self.router_watcher is not None:
            self.router_watcher.stop()
            self.router_watcher.store.close()
        self.runtime.close()


def wire_replica(
    config: OSDConfig,
    *,
    log_writer: Any = None,
    store: AdapterStore | None = None,
    redis_url: str = "",
    reconcile_interval_s: float | None = None,
    rollback_window: int | None = None,
    health_limits: HealthLimits | None = None,
    health_interval_s: float = 2.0,
) -> WiredReplica:
    """Builds and starts one replica: models, metrics, the watcher of `store` (None: adapters
    stay at the base draft) with its live monitor, the loop health probe (of `redis_url`'s log
    stream and the trainer behind it), and the runtime. The watcher reconciles once before this
    returns, so the first request already uses the published versions. Intervals and the
    rollback window default to `config.adapters`'."""
    a = config.adapters
    models = load_replica_models(config)
    metrics = ReplicaMetrics(model_name=config.serve.model_name)
    events: deque[dict[str, Any]] = deque(maxlen=RECENT_ADAPTER_EVENTS)
    interval_s = a.reconcile_interval_s if reconcile_interval_s is None else reconcile_interval_s
    monitor, watcher = None, None
    routes_by_content = bool(redis_url) and config.routing.enabled
    if store is not None or routes_by_content:
        monitor = LiveMonitor(
            a.rollback_window if rollback_window is None else rollback_window, a.rollback_margin
        )
    if store is not None:
        assert monitor is not None
        watcher = VersionWatcher(
            store,
            AdapterHolder(models.slots, monitor, metrics),
            events=events,
            reconcile_interval_s=interval_s,
            name="adapter-watcher",
        )
    health = LoopHealth(
        models.slots,
        metrics,
        log_writer=log_writer,
        redis_url=redis_url,
        store=store,
        stream=config.log.stream,
        group=config.trainer.group,
        refused=watcher.refused if watcher is not None else set,
        limits=health_limits,
        interval_s=health_interval_s,
    )
    runtime = build_runtime(
        config,
        models,
        metrics=metrics,
        log_writer=log_writer,
        monitor=monitor,
        events=events,
        health=health,
    )
    if watcher is not None:
        watcher.start()
    router_watcher = None
    if routes_by_content and monitor is not None:  # the routing model is in the log's Redis
        router_watcher = VersionWatcher(
            open_routing_store(redis_url),
            RouterTrial(
                runtime.router,
                monitor,
                config.routing.trial_share,
                routing_model_name(config.log.stream),
            ),
            events=events,
            reconcile_interval_s=interval_s,
            replica_id=watcher.replica_id if watcher is not None else None,
            name="router-watcher",
        )
        router_watcher.start()
    health.start()
    warmup = None
    if redis_url and config.spec.suffix_warm_records:  # suffix decoding is not cold at start
        warmup = SuffixWarmup(
            runtime.engine.proposers, redis_url, config.log.stream, config.spec.suffix_warm_records
        ).start()
    return WiredReplica(runtime, watcher, health, router_watcher, warmup)
