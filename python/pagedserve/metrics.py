"""Prometheus metrics for the engine, under vLLM's metric names.

The names, types, label (`model_name`) and histogram buckets follow vLLM v1's
PrometheusStatLogger (vllm/v1/metrics/loggers.py), so Grafana dashboards and
alerts written for vLLM work unchanged. vLLM also labels by `engine` (its
data-parallel index); PagedServe has one engine per server, so it omits it.

Units: times in seconds, sizes in tokens, KV-cache usage as a fraction 0..1.
The process collectors add process_resident_memory_bytes, process_cpu_seconds_total,
process_open_fds and python_gc_* (prometheus_client's standard names).

Each EngineMetrics owns its own CollectorRegistry (several engines may live in
one process; the global REGISTRY is never touched). Thread safety:
prometheus_client metrics are thread-safe, so the engine thread may write while
the HTTP thread calls render(); the small delta bookkeeping of
observe_scheduler() is guarded by a lock of its own.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values

# Bucket boundaries copied from vLLM v1 (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM uses its time_per_output_token buckets for inter_token_latency as well.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
# Shared by e2e latency and queue time, as in vLLM.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class EngineMetrics:
    """One engine's Prometheus metrics, in a registry of its own (`self.registry`).

    Gauges: vllm:num_requests_running, vllm:num_requests_waiting (requests),
    vllm:kv_cache_usage_perc (fraction 0..1 of KV blocks in use).
    Counters (exposed with _total): vllm:prefix_cache_queries / _hits (tokens),
    vllm:prompt_tokens, vllm:generation_tokens (tokens),
    vllm:request_success{finished_reason=stop|length|abort}, vllm:num_preemptions.
    Histograms: vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds (seconds),
    vllm:request_prompt_tokens, vllm:request_generation_tokens (tokens);
    with --scheduling-policy priority also
    pagedserve:request_queue_time_by_priority_seconds{priority=...} (seconds;
    at most MAX_PRIORITY_LABELS distinct values, later ones under "other", so
    clients cannot grow the registry without bound).

    max_model_len only sets the token-count histogram buckets (1-2-5 steps up to
    it, as vLLM does); per_priority registers the per-priority queue time.
    """

    MAX_PRIORITY_LABELS = 32

    def __init__(self, model_name: str, max_model_len: int = 32768, per_priority: bool = False,
                 speculative: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, L = self.registry, ["model_name"]
        # the process's own figures, under the standard names vLLM's /metrics carries too:
        # process_resident_memory_bytes, process_cpu_seconds_total, process_open_fds, python_gc_*, python_info
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        PlatformCollector(registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, L, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, L, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, L, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        # speculative decoding (only when it is on, as vLLM registers them)
        self.spec_decode_num_drafts = self.spec_decode_num_draft_tokens = self.spec_decode_num_accepted_tokens = None
        if speculative:
            self.spec_decode_num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.spec_decode_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                                           "Number of accepted tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                L + ["finished_reason"], registry=r)
        for reason in FINISHED_REASONS:  # present at 0 from the start, as in vLLM
            self._success.labels(model_name, reason)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self._queue_time_by_priority = Histogram(
            "pagedserve:request_queue_time_by_priority_seconds",
            "Histogram of time spent in WAITING phase for request, per request priority (priority policy).",
            L + ["priority"], buckets=REQUEST_LATENCY_BUCKETS, registry=r) if per_priority else None
        self._priority_labels: set[str] = set()
        token_buckets = build_1_2_5_buckets(max(1, max_model_len))
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)

        self._lock = threading.Lock()
        self._last = {"queries": 0, "hits": 0, "preemptions": 0}  # last cumulative totals seen

    def _advance(self, key: str, total: int, counter) -> None:
        """Increments counter by total's growth since the last call. A smaller
        total (the engine's count was reset) adds nothing and becomes the new base."""
        delta = total - self._last[key]
        self._last[key] = total
        if delta > 0:
            counter.inc(delta)

    def observe_scheduler(self, num_running: int, num_waiting: int, kv_cache_usage: float,
                          prefix_cache_queries: int, prefix_cache_hits: int, num_preemptions: int) -> None:
        """Scheduler state after a step. Gauges are set (requests; kv_cache_usage as a
        fraction 0..1). The last three are the engine's CUMULATIVE totals (tokens
        queried / hit in the prefix cache, preemptions); the counters grow by the delta
        since the previous call and never decrease."""
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_cache_usage.set(kv_cache_usage)
        with self._lock:
            self._advance("queries", prefix_cache_queries, self.prefix_cache_queries)
            self._advance("hits", prefix_cache_hits, self.prefix_cache_hits)
            self._advance("preemptions", num_preemptions, self.num_preemptions)

    def observe_spec_decode(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One step's speculative decoding: sequences verified, draft tokens
        computed, of those accepted (acceptance rate = accepted / draft tokens)."""
        if self.spec_decode_num_drafts is None:
            return
        self.spec_decode_num_drafts.inc(num_drafts)
        self.spec_decode_num_draft_tokens.inc(num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(num_accepted_tokens)

    def observe_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Tokens processed by one engine step (prefill tokens computed, tokens generated)."""
        if num_prompt_tokens > 0:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens > 0:
            self.generation_tokens.inc(num_generation_tokens)

    def observe_first_token(self, ttft_s: float, queue_time_s: float, priority: int = 0) -> None:
        """A request's first token: time to first token and time spent waiting
        (seconds); the wait is also observed under the request's priority when
        the metrics were made with per_priority."""
        self.ttft.observe(ttft_s)
        self.queue_time.observe(queue_time_s)
        if self._queue_time_by_priority is not None:
            label = str(priority)
            with self._lock:
                if label not in self._priority_labels:
                    if len(self._priority_labels) >= self.MAX_PRIORITY_LABELS:
                        label = "other"
                    self._priority_labels.add(label)
            self._queue_time_by_priority.labels(self.model_name, label).observe(queue_time_s)

    def observe_inter_token(self, latencies_s: list[float]) -> None:
        """Gaps between consecutive output tokens (seconds), one observation each."""
        for s in latencies_s:
            self.itl.observe(s)

    def observe_finished(self, finished_reason: str, num_prompt_tokens: int, num_generation_tokens: int,
                         e2e_s: float) -> None:
        """A finished request: its finish reason ("stop", "length" or "abort"), its
        prompt and generated lengths (tokens) and its end-to-end latency (seconds)."""
        self._success.labels(self.model_name, finished_reason).inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        self.e2e.observe(e2e_s)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition of this registry."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
