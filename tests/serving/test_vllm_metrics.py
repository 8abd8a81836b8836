"""vLLM's metric names beside osd's own (serving.vllm_metrics): names, labels and vLLM's
meaning of each count, from hand-made requests (no server)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from serving.metrics import ReplicaMetrics


def _samples(metrics: ReplicaMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.export().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


LABELS = (("engine", "0"), ("model_name", "my-model"))


def test_spec_decode_counts_mean_what_vllm_means():
    metrics = ReplicaMetrics(model_name="my-model")
    # Steps: the prefill's token (nothing drafted), then drafts of 4, 4, 2 and 0 tokens.
    metrics.observe_generation(
        "general",
        3,
        "sql",
        9,
        [0, 4, 4, 2, 0],
        [0, 4, 1, 0, 0],
        prompt_tokens=7,
        finish_reason="length",
    )
    metrics.observe_generation(
        "general", 3, "sql", 2, [0, 1], [0, 1], prompt_tokens=5, finish_reason="stop"
    )
    got = _samples(metrics)

    def value(name: str, **extra: str) -> float:
        return got[(name, tuple(sorted((*LABELS, *extra.items()))))]

    assert value("vllm:spec_decode_num_drafts_total") == 4  # steps that drafted
    assert value("vllm:spec_decode_num_draft_tokens_total") == 11
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 6
    # Drafts whose token at each position (0 first) was accepted: 4 -> 0..3, 1 -> 0, 1 -> 0.
    per_pos = [
        value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
        for p in range(4)
    ]
    assert per_pos == [3, 1, 1, 1]
    assert value("vllm:generation_tokens_total") == 11
    assert value("vllm:prompt_tokens_total") == 12
    assert value("vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:request_success_total", finished_reason="stop") == 1
    # osd's own counts agree.
    drafted = got[
        ("osd_drafted_tokens_total", (("adapter", "general"), ("domain", "sql"), ("version", "3")))
    ]
    assert drafted == 11


def test_latencies_and_the_batch_under_vllm_names():
    metrics = ReplicaMetrics(model_name="my-model")
    metrics.observe_latency(1.5, 0.2)
    metrics.observe_latency(0.9, None)  # a request that never produced a token
    metrics.observe_itl(0.03)
    metrics.observe_batch(running=5, waiting=2, mean_rows=4.5, steps=10)
    got = _samples(metrics)
    assert got[("vllm:num_requests_running", LABELS)] == 5
    assert got[("vllm:num_requests_waiting", LABELS)] == 2
    assert got[("vllm:e2e_request_latency_seconds_count", LABELS)] == 2
    assert got[("vllm:time_to_first_token_seconds_count", LABELS)] == 1
    assert got[("vllm:time_to_first_token_seconds_sum", LABELS)] == 0.2
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert got[(f"{name}_count", LABELS)] == 1
    assert (
        got[("osd_batch_rows", ())] == 5 and got[("osd_time_to_first_token_seconds_count", ())] == 1
    )


def test_prefix_cache_queries_and_hits_follow_the_loops_totals():
    """Read at each scrape from the decode loop's running totals (prompt tokens admitted,
    of them copied from cached KV), counted on without double counting."""
    metrics = ReplicaMetrics(model_name="my-model")
    metrics.observe_prefix_cache(queried=100, hit=40)
    metrics.observe_prefix_cache(queried=100, hit=40)  # a scrape with nothing new
    metrics.observe_prefix_cache(queried=160, hit=70)
    got = _samples(metrics)
    assert got[("vllm:prefix_cache_queries_total", LABELS)] == 160
    assert got[("vllm:prefix_cache_hits_total", LABELS)] == 70
