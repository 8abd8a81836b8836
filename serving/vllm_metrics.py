"""vLLM's metric names, beside osd's own, so a dashboard or alert built for vLLM reads a replica
unchanged.

Names, types, labels (``model_name``: ``serve.model_name``; ``engine``: "0", one engine a
replica) and meaning as vLLM's V1 engine exports them (``vllm/v1/metrics/loggers.py`` and
``vllm/v1/spec_decode/metrics.py``):

- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: requests in the decode loop's
  batch / waiting for a row, read at scrape time;
- ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, and
  ``vllm:request_success_total{finished_reason}`` (``stop`` or ``length``);
- ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: prompt tokens of
  admitted requests / of them copied from another slot's KV rather than prefilled
  (``osd.decode.prefix_reuse``), so ``hits / queries`` is the prefix cache's hit rate;
- ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (and its older name
  ``vllm:time_per_output_token_seconds``), ``vllm:e2e_request_latency_seconds``;
- speculative decoding: ``vllm:spec_decode_num_drafts_total`` (steps of a request that drafted
  at least one token, whoever drafted it), ``vllm:spec_decode_num_draft_tokens_total``,
  ``vllm:spec_decode_num_accepted_tokens_total``, and
  ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}``: drafts whose token at that
  position (0 first) was accepted, so ``per_pos / num_drafts`` is vLLM's per-position
  acceptance and ``1 + accepted / num_drafts`` its mean acceptance length.

osd's own ``osd_*`` metrics keep the splits vLLM has no label for (adapter, version, domain,
proposer). Each replica has its registry; Ray Serve's replicas are scraped one by one, as
vLLM's data-parallel engines are.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["VllmMetrics"]

# vLLM's own buckets (seconds).
_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
_ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0),
)
_E2E_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)

_LABELS = ["model_name", "engine"]


class VllmMetrics:
    """The vLLM-named metrics of one replica, in its registry (module docstring)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, labels = registry, (model_name, "0")
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", _LABELS, registry=r
        ).labels(*labels)
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"],
            registry=r,
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self._prefix_seen = (0, 0)  # the loop's totals at the last scrape
        self._labels = labels
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _LABELS,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(*labels)
        self.itl = [
            Histogram(name, doc, _LABELS, buckets=_ITL_BUCKETS, registry=r).labels(*labels)
            for name, doc in (
                (
                    "vllm:inter_token_latency_seconds",
                    "Histogram of inter-token latency in seconds.",
                ),
                (
                    "vllm:time_per_output_token_seconds",
                    "Histogram of time per output token in seconds.",
                ),
            )
        ]
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LABELS,
            buckets=_E2E_BUCKETS,
            registry=r,
        ).labels(*labels)
        self.num_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", _LABELS, registry=r
        ).labels(*labels)
        self.num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", _LABELS, registry=r
        ).labels(*labels)
        self.num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self._per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*_LABELS, "position"],
            registry=r,
        )

    def observe_request(
        self,
        *,
        prompt_tokens: int,
        generated: int,
        finish_reason: str,
        num_drafted: Sequence[int],
        num_accepted: Sequence[int],
    ) -> None:
        """One finished choice: its tokens, outcome and steps (drafted and accepted per step)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self._success.labels(*self._labels, finish_reason).inc()
        accepted_at: dict[int, int] = {}
        for drafted, accepted in zip(num_drafted, num_accepted, strict=True):
            if drafted == 0:
                continue
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            for position in range(accepted):
                accepted_at[position] = accepted_at.get(position, 0) + 1
        for position, count in sorted(accepted_at.items()):
            self._per_pos.labels(*self._labels, str(position)).inc(count)

    def observe_latency(self, seconds: float, ttft: float | None) -> None:
        self.e2e.observe(seconds)
        if ttft is not None:
            self.ttft.observe(ttft)

    def observe_itl(self, seconds: float) -> None:
        for histogram in self.itl:
            histogram.observe(seconds)

    def observe_batch(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def observe_prefix_cache(self, queried: int, hit: int) -> None:
        """The decode loop's running totals (read at scrape time) into the counters."""
        seen_queried, seen_hit = self._prefix_seen
        self.prefix_queries.inc(max(queried - seen_queried, 0))
        self.prefix_hits.inc(max(hit - seen_hit, 0))
        self._prefix_seen = (queried, hit)
