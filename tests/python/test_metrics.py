"""EngineMetrics: vLLM metric names, model_name labels, counter deltas, histograms."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.metrics import EngineMetrics

MODEL = "test-model"
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
COUNTERS = ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:num_preemptions_total"]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]


def samples(m: EngineMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from render(), parsed as Prometheus text."""
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: EngineMetrics, name: str, **labels) -> float:
    return samples(m)[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def test_every_vllm_name_is_exposed_with_model_name():
    m = EngineMetrics(MODEL)
    s = samples(m)
    names = {name for name, _ in s}
    for name in GAUGES + COUNTERS + [h + suffix for h in HISTOGRAMS for suffix in ("_count", "_sum", "_bucket")]:
        assert name in names, name
        assert all(dict(labels).get("model_name") == MODEL for n, labels in s if n == name), name
    body = m.render()[0].decode()
    for name in HISTOGRAMS:
        assert f"# TYPE {name} histogram" in body
    for name in COUNTERS:
        assert f"# TYPE {name} counter" in body


def test_registry_is_per_instance():
    a, b = EngineMetrics("a"), EngineMetrics("b")  # same names twice: no "Duplicated timeseries"
    assert a.registry is not b.registry and a.registry is not REGISTRY
    assert REGISTRY.get_sample_value("vllm:num_requests_running", {"model_name": "a"}) is None
    a.observe_tokens(3, 0)
    assert value(a, "vllm:prompt_tokens_total", model_name="a") == 3
    assert value(b, "vllm:prompt_tokens_total", model_name="b") == 0


def test_scheduler_gauges_and_cumulative_counters():
    m = EngineMetrics(MODEL)
    m.observe_scheduler(3, 2, 0.25, prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1)
    assert value(m, "vllm:num_requests_running") == 3
    assert value(m, "vllm:num_requests_waiting") == 2
    assert value(m, "vllm:kv_cache_usage_perc") == 0.25
    assert value(m, "vllm:prefix_cache_queries_total") == 10
    m.observe_scheduler(1, 0, 0.5, prefix_cache_queries=25, prefix_cache_hits=4, num_preemptions=3)
    assert value(m, "vllm:num_requests_running") == 1
    assert value(m, "vllm:kv_cache_usage_perc") == 0.5
    assert value(m, "vllm:prefix_cache_queries_total") == 25
    assert value(m, "vllm:prefix_cache_hits_total") == 4
    assert value(m, "vllm:num_preemptions_total") == 3
    # a smaller cumulative total never decreases a counter
    m.observe_scheduler(0, 0, 0.0, prefix_cache_queries=5, prefix_cache_hits=0, num_preemptions=0)
    assert value(m, "vllm:prefix_cache_queries_total") == 25
    assert value(m, "vllm:prefix_cache_hits_total") == 4
    assert value(m, "vllm:num_preemptions_total") == 3


def test_token_counters():
    m = EngineMetrics(MODEL)
    m.observe_tokens(7, 0)
    m.observe_tokens(0, 2)
    m.observe_tokens(1, 3)
    assert value(m, "vllm:prompt_tokens_total") == 8
    assert value(m, "vllm:generation_tokens_total") == 5


def test_histograms_count_and_sum():
    m = EngineMetrics(MODEL, max_model_len=1000)
    m.observe_first_token(0.5, 0.125)
    m.observe_first_token(0.25, 0.0)
    m.observe_inter_token([0.01, 0.02, 0.03])
    m.observe_inter_token([])
    m.observe_finished("stop", 12, 30, 2.0)
    m.observe_finished("length", 8, 100, 3.5)
    expect = {"vllm:time_to_first_token_seconds": (2, 0.75), "vllm:request_queue_time_seconds": (2, 0.125),
              "vllm:inter_token_latency_seconds": (3, 0.06), "vllm:e2e_request_latency_seconds": (2, 5.5),
              "vllm:request_prompt_tokens": (2, 20), "vllm:request_generation_tokens": (2, 130)}
    for name, (count, total) in expect.items():
        assert value(m, name + "_count") == count, name
        assert value(m, name + "_sum") == pytest.approx(total), name
    # buckets are cumulative; 1-2-5 token buckets up to max_model_len, as vLLM
    assert value(m, "vllm:request_prompt_tokens_bucket", le="10.0") == 1
    assert value(m, "vllm:request_prompt_tokens_bucket", le="20.0") == 2
    assert value(m, "vllm:request_generation_tokens_bucket", le="500.0") == 2
    assert ("vllm:request_prompt_tokens_bucket", tuple(sorted({"model_name": MODEL, "le": "1000.0"}.items()))) \
        in samples(m)
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == 2


def test_request_success_by_finished_reason():
    m = EngineMetrics(MODEL)
    for reason in ("stop", "length", "abort"):
        assert value(m, "vllm:request_success_total", finished_reason=reason) == 0
    m.observe_finished("stop", 1, 1, 0.1)
    m.observe_finished("stop", 1, 1, 0.1)
    m.observe_finished("abort", 1, 0, 0.1)
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 2
    assert value(m, "vllm:request_success_total", finished_reason="length") == 0
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
