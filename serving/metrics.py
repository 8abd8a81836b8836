"""Prometheus metrics of one replica (exported at ``/metrics``): osd's own ``osd_*``, and the
same measurements under vLLM's names (:mod:`serving.vllm_metrics`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from osd.decode.compiled_forward import compile_stats
from serving.vllm_metrics import VllmMetrics

__all__ = ["ReplicaMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class ReplicaMetrics:
    """Counters, gauges and histograms; each replica has its own registry."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    model_name: str = "osd"  # vLLM's model_name label (serve.model_name)

    def __post_init__(self) -> None:
        r, labels = self.registry, ["adapter", "version", "domain"]
        self.vllm = VllmMetrics(r, self.model_name)
        self.requests = Counter(
            "osd_requests", "Requests by outcome", ["endpoint", "status"], registry=r
        )
        self.tokens = Counter("osd_generated_tokens", "Generated tokens", labels, registry=r)
        self.drafted = Counter("osd_drafted_tokens", "Drafted tokens", labels, registry=r)
        self.accepted = Counter(
            "osd_accepted_tokens", "Accepted drafted tokens", labels, registry=r
        )
        self.accepted_at = Counter(
            "osd_accepted_by_position",
            "Steps whose draft was accepted at least to this position",
            ["adapter", "position"],
            registry=r,
        )
        self.steps = Counter("osd_steps", "Target verification calls", labels, registry=r)
        # Per proposer (osd.decode.proposers): draft model, suffix decoding, prompt lookup.
        self.proposer_steps = Counter(
            "osd_proposer_steps", "Steps that drafted, by proposer", ["proposer"], registry=r
        )
        self.proposer_drafted = Counter(
            "osd_proposer_drafted_tokens", "Drafted tokens by proposer", ["proposer"], registry=r
        )
        self.proposer_accepted = Counter(
            "osd_proposer_accepted_tokens",
            "Accepted drafted tokens by proposer",
            ["proposer"],
            registry=r,
        )
        self.ttft = Histogram(
            "osd_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "osd_inter_token_latency_seconds",
            "Time per generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "osd_request_latency_seconds", "Request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.in_flight = Gauge("osd_requests_in_flight", "Requests being decoded", registry=r)
        self.batch_rows = Gauge(
            "osd_batch_rows",
            "Requests in the decode loop's batch (decoding or prefilling)",
            registry=r,
        )
        self.batch_waiting = Gauge(
            "osd_batch_waiting", "Requests waiting for a row of the decode loop", registry=r
        )
        self.batch_mean = Gauge(
            "osd_batch_mean_rows", "Mean rows per decode step since the replica started", registry=r
        )
        self.draft_length = Histogram(
            "osd_draft_length_chosen",
            "Tokens drafted per step (0: the target alone)",
            buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16),
            registry=r,
        )
        self.decode_steps = Gauge(
            "osd_decode_steps", "Batched decode steps since the replica started", registry=r
        )
        self.warmup_seconds = Gauge(
            "osd_engine_warmup_seconds",
            "Seconds the decode loop's warm-up took before the replica was ready (0: none)",
            registry=r,
        )
        self.compilations = Gauge(
            "osd_engine_compilations_total",
            "Graphs torch.compile compiled in the replica's process (model.compile; the "
            "warm-up compiles them all: a rise while serving is a recompilation)",
            registry=r,
        )
        self.cuda_graphs = Gauge(
            "osd_engine_cuda_graphs_captured_total",
            "CUDA graphs the replica's lean forwards captured (model.cuda_graphs; one per batch "
            "bucket, tokens a row and key bucket, on first use; 0 off CUDA)",
            registry=r,
        )
        self.compile_seconds = Gauge(
            "osd_engine_compile_seconds",
            "Seconds inductor spent compiling those graphs",
            registry=r,
        )
        self.log_written = Gauge("osd_log_records_written", "Records written to Redis", registry=r)
        self.log_dropped = Gauge("osd_log_records_dropped", "Records dropped", registry=r)
        self.log_opted_out = Gauge(
            "osd_log_records_opted_out", "Requests that opted out", registry=r
        )
        self.log_trim_len = Gauge(
            "osd_log_stream_trim_len",
            "Stream length the writer trims to (log.maxlen, or less under log.max_bytes)",
            registry=r,
        )
        self.log_record_bytes = Gauge(
            "osd_log_record_bytes_mean", "Mean bytes of a record sent to Redis", registry=r
        )
        self.swaps = Counter(
            "osd_adapter_swaps", "Adapter versions swapped in", ["adapter"], registry=r
        )
        self.rollbacks = Counter(
            "osd_adapter_rollbacks", "Adapter versions rolled back", ["adapter"], registry=r
        )
        self.refused = Counter(
            "osd_adapter_refusals",
            "Adapter versions refused by the loader",
            ["adapter", "reason"],
            registry=r,
        )
        # The loop around the replica (serving.health), set at each probe.
        self.loop_part_ok = Gauge(
            "osd_loop_part_ok",
            "1 if this part of the loop works (or is off), 0 if degraded",
            ["part"],
            registry=r,
        )
        self.trainer_lag = Gauge(
            "osd_trainer_lag_records", "Records never delivered to the trainer's group", registry=r
        )
        self.trainer_pending = Gauge(
            "osd_trainer_pending_records",
            "Records the trainer read but has not acknowledged",
            registry=r,
        )
        self.trainer_heartbeat_age = Gauge(
            "osd_trainer_heartbeat_age_seconds", "Age of the trainer's last heartbeat", registry=r
        )
        self.trainer_last_ack_age = Gauge(
            "osd_trainer_last_ack_age_seconds",
            "Time since the trainer last acknowledged a record",
            registry=r,
        )
        self.adapter_behind = Gauge(
            "osd_adapter_behind",
            "1 while the replica serves another version than the published one",
            ["adapter"],
            registry=r,
        )
        self.router_fallbacks = Counter(
            "osd_router_fallbacks", "Unknown drafts sent to general", registry=r
        )

    def observe_generation(
        self,
        adapter: str,
        version: int,
        domain: str,
        num_generated: int,
        num_drafted: list[int],
        num_accepted: list[int],
        by_proposer: Mapping[str, Sequence[int]] | None = None,
        *,
        prompt_tokens: int = 0,
        finish_reason: str = "stop",
    ) -> None:
        """Counts one finished request's tokens (``by_proposer``: steps, drafted and accepted
        per proposer, as ``GenerationStats.by_proposer``)."""
        self.vllm.observe_request(
            prompt_tokens=prompt_tokens,
            generated=num_generated,
            finish_reason=finish_reason,
            num_drafted=num_drafted,
            num_accepted=num_accepted,
        )
        labels = (adapter, str(version), domain or "none")
        self.tokens.labels(*labels).inc(num_generated)
        self.drafted.labels(*labels).inc(sum(num_drafted))
        self.accepted.labels(*labels).inc(sum(num_accepted))
        self.steps.labels(*labels).inc(len(num_drafted))
        for name, (steps, drafted, accepted) in (by_proposer or {}).items():
            self.proposer_steps.labels(name).inc(steps)
            self.proposer_drafted.labels(name).inc(drafted)
            self.proposer_accepted.labels(name).inc(accepted)
        for drafted in num_drafted:
            self.draft_length.observe(drafted)
        for accepted in num_accepted:
            for position in range(1, accepted + 1):
                self.accepted_at.labels(adapter, str(position)).inc()

    def observe_latency(self, seconds: float, ttft: float | None) -> None:
        """A finished request's latency and time to its first token (None: it had none)."""
        self.latency.observe(seconds)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.vllm.observe_latency(seconds, ttft)

    def observe_itl(self, seconds: float) -> None:
        """A finished choice's mean time per token after its first."""
        self.itl.observe(seconds)
        self.vllm.observe_itl(seconds)

    def observe_batch(self, running: int, waiting: int, mean_rows: float, steps: int) -> None:
        """The decode loop's batch, read at scrape time."""
        self.batch_rows.set(running)
        self.batch_waiting.set(waiting)
        self.batch_mean.set(mean_rows)
        self.decode_steps.set(steps)
        compiled = compile_stats()
        self.compilations.set(compiled.compilations)
        self.compile_seconds.set(compiled.seconds)
        self.cuda_graphs.set(compiled.captures)
        self.vllm.observe_batch(running, waiting)

    def observe_prefix_cache(self, queried: int, hit: int) -> None:
        """Prompt tokens admitted and those copied from cached KV (the loop's totals)."""
        self.vllm.observe_prefix_cache(queried, hit)

    def adapter_swapped(self, adapter: str) -> None:
        self.swaps.labels(adapter).inc()

    def adapter_rolled_back(self, adapter: str) -> None:
        self.rollbacks.labels(adapter).inc()

    def adapter_refused(self, adapter: str, reason: str) -> None:
        """A version the loader refused; `reason` says why (serving.watcher.refusal_reason)."""
        self.refused.labels(adapter, reason).inc()

    def observe_writer(self, counts: Any) -> None:
        """The log writer's counters (a ``WriterMetrics``), read at scrape time."""
        self.log_written.set(counts.written)
        self.log_dropped.set(counts.dropped)
        self.log_opted_out.set(counts.opted_out)
        self.log_trim_len.set(counts.trim_len)
        self.log_record_bytes.set(counts.mean_record_bytes)

    def export(self) -> bytes:
        return generate_latest(self.registry)
