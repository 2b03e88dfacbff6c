"""`/metrics`: SGLang's Prometheus families over one private registry (or vLLM's).

As in docs/reference/sglang.md#metrics.

Counters and histograms are updated when a request ends; gauges are read from the scheduler
at scrape time, so a scrape always sees the current `num_running_reqs`. Every sample carries
`model_name` (the served name); scheduler gauges add `engine_type, tp_rank, pp_rank,
moe_ep_rank`, tokenizer metrics add `engine_type` and `is_streaming`.

With --flavor vllm the families are vLLM 0.11.0's (`vllm/v1/metrics/loggers.py`
PrometheusStatLogger), labelled `model_name` and `engine` ("0", one engine core); the strict
flavour has no /metrics at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from launcher.sim.capacity import AVAIL_BEFORE_LOAD_GB, Capacity
from launcher.sim.config import SimConfig
from launcher.sim.scheduler import Scheduler, SimRequest

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400)
QUEUE_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90,
                 100, 200, 300, 400, 500, 600, 1200, 1800, 2400, 3000)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _SchedulerGauges(Collector):
    """Gauges computed from the scheduler's state when scraped."""

    def __init__(self, cfg: SimConfig, capacity: Capacity, scheduler: Scheduler) -> None:
        self.cfg, self.capacity, self.scheduler = cfg, capacity, scheduler
        self.labels = {"model_name": cfg.served_name, "engine_type": "unified", "tp_rank": "0",
                       "pp_rank": "0", "moe_ep_rank": "0"}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        sched, cap = self.scheduler, self.capacity
        stats = sched.stats(sched.now())
        usage = round(max(stats.token_usage, stats.mamba_usage), 2)
        values: list[tuple[str, str, float]] = [
            ("num_running_reqs", "The number of running requests.", stats.running),
            ("num_queue_reqs", "The number of requests in the waiting queue.", stats.queued),
            ("num_grammar_queue_reqs", "The number of requests in the grammar queue.", 0),
            ("num_retracted_reqs", "The number of retracted requests.", 0),
            ("num_paused_reqs", "The number of paused requests.", 0),
            ("gen_throughput", "The generation throughput (token/s).", sched.last_gen_throughput),
            ("token_usage", "The token usage.", usage),
            ("full_token_usage", "The full-attention token usage.", stats.token_usage),
            ("num_used_tokens", "The number of used tokens.", stats.tokens),
            ("kv_used_tokens", "KV tokens in use.", stats.tokens),
            ("kv_available_tokens", "KV tokens free.", cap.max_total_num_tokens - stats.tokens),
            ("kv_evictable_tokens", "KV tokens evictable from the prefix cache.", 0),
            ("cache_hit_rate", "The prefix cache hit rate.", 0.0),
            ("is_cuda_graph", "Whether the last batch ran with CUDA graph.",
             float(stats.cuda_graph)),
            ("max_total_num_tokens", "Maximum total number of tokens in the KV pool.",
             cap.max_total_num_tokens),
            ("context_len", "The context length.", self.cfg.context_len),
            ("page_size", "The page size.", 1),
            ("weight_memory_usage_gb", "Weight memory (GB).", cap.weights_gb),
            ("kv_cache_memory_usage_gb", "KV cache memory (GB).", cap.kv_gb),
            ("startup_available_gpu_memory_gb", "GPU memory available at start-up (GB).",
             AVAIL_BEFORE_LOAD_GB),
        ]
        if cap.mamba_cache_size:
            used = stats.mamba_num or 0
            values += [("mamba_usage", "The mamba state usage.", stats.mamba_usage),
                       ("mamba_used_tokens", "Mamba state slots in use.", used),
                       ("mamba_available_tokens", "Mamba state slots free.",
                        cap.mamba_cache_size - used),
                       ("mamba_evictable_tokens", "Mamba state slots evictable.", 0)]
        if self.cfg.speculative:
            values += [("spec_accept_length", "The average acceptance length.",
                        self.cfg.speculative_accept_length),
                       ("spec_accept_rate", "The average acceptance rate.", sched.accept_rate()),
                       ("spec_num_steps", "Speculative draft steps.", cap.spec_steps or 0),
                       ("spec_num_draft_tokens", "Speculative draft tokens.",
                        cap.spec_draft_tokens or 0)]
        for name, doc, value in values:
            yield self._gauge("sglang:" + name, doc, float(value))


class SimMetrics:
    """The registry behind /metrics, fed by `observe` when a request ends."""

    def __init__(self, cfg: SimConfig, capacity: Capacity, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        names = ["model_name", "engine_type", "is_streaming"]
        reg = self.registry

        def counter(name: str, doc: str, labels: list[str] = names) -> Counter:
            return Counter("sglang:" + name, doc, labels, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram("sglang:" + name, doc, names, buckets=buckets, registry=reg)

        prompt = counter("prompt_tokens", "Number of prefill tokens processed.")
        generation = counter("generation_tokens", "Number of generation tokens processed.")
        requests = counter("num_requests", "Number of requests processed.")
        ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                        E2E_BUCKETS)
        queue = histogram("queue_time_seconds", "Time spent in the waiting queue.",
                          QUEUE_BUCKETS)
        aborted = counter("num_aborted_requests", "Number of aborted requests.",
                          ["model_name", "engine_type"])
        base = (cfg.served_name, "unified")
        # children resolved once: labels() lookups would dominate at thousands of requests/s
        self._by_stream = {s: (prompt.labels(*base, s), generation.labels(*base, s),
                               requests.labels(*base, s), ttft.labels(*base, s),
                               e2e.labels(*base, s), queue.labels(*base, s))
                           for s in ("true", "false")}
        self._aborted = aborted.labels(*base)
        reg.register(_SchedulerGauges(cfg, capacity, scheduler))

    def observe(self, req: SimRequest, now: float) -> None:
        """Count a finished (or aborted) request."""
        prompt, generation, requests, ttft, e2e, queue = self._by_stream[
            "true" if req.streaming else "false"]
        prompt.inc(req.input_tokens)
        generation.inc(req.completion_tokens)
        requests.inc()
        e2e.observe(now - req.arrival)
        if req.admitted_at is not None:
            queue.observe(req.admitted_at - req.arrival)
            if req.completion_tokens:
                ttft.observe(req.first_token_at() - req.arrival)
        if req.aborted:
            self._aborted.inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


# vLLM 0.11.0's buckets (PrometheusStatLogger)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_FINISH_REASONS = ("stop", "length", "abort")  # vllm.v1.engine.FinishReason


def _buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(float(mantissa * scale))
        scale *= 10


class Metrics(Protocol):
    """What the simulator feeds and /metrics reads, whichever engine's families it has."""

    def observe(self, req: SimRequest, now: float) -> None:
        """Count a finished (or aborted) request."""

    def render(self) -> bytes:
        """The Prometheus text exposition."""


class _VllmGauges(Collector):
    """vLLM's scheduler gauges, read when scraped."""

    def __init__(self, cfg: SimConfig, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.labels = {"model_name": cfg.served_name, "engine": "0"}

    def collect(self) -> Iterator[Metric]:
        stats = self.scheduler.stats(self.scheduler.now())
        for name, doc, value in (
                ("num_requests_running", "Number of requests in model execution batches.",
                 stats.running),
                ("num_requests_waiting", "Number of requests waiting to be processed.",
                 stats.queued),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 max(stats.token_usage, stats.mamba_usage))):
            family = GaugeMetricFamily("vllm:" + name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), float(value))
            yield family


class VllmMetrics:
    """vLLM 0.11.0's families (the ones a scraper of vLLM reads), fed when a request ends."""

    def __init__(self, cfg: SimConfig, scheduler: Scheduler) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=False)
        names = ["model_name", "engine"]
        base = (cfg.served_name, "0")

        def counter(name: str, doc: str) -> Counter:
            return Counter("vllm:" + name, doc, names, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram("vllm:" + name, doc, names, buckets=buckets, registry=reg)

        counter("num_preemptions", "Cumulative number of preemption from the engine.")\
            .labels(*base)
        self._prompt = counter("prompt_tokens", "Number of prefill tokens processed.")\
            .labels(*base)
        self._generation = counter("generation_tokens", "Number of generation tokens processed.")\
            .labels(*base)
        self._cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")\
            .labels(*base)
        counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")\
            .labels(*base)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=reg)
        self._success = {r: success.labels(*base, r) for r in VLLM_FINISH_REASONS}
        token_buckets = _buckets_1_2_5(cfg.context_len)
        self._prompt_hist = histogram("request_prompt_tokens",
                                      "Number of prefill tokens processed.", token_buckets)\
            .labels(*base)
        self._generation_hist = histogram("request_generation_tokens",
                                          "Number of generation tokens processed.",
                                          token_buckets).labels(*base)
        self._ttft = histogram("time_to_first_token_seconds",
                               "Histogram of time to first token in seconds.",
                               VLLM_TTFT_BUCKETS).labels(*base)
        self._e2e = histogram("e2e_request_latency_seconds",
                              "Histogram of e2e request latency in seconds.",
                              VLLM_LATENCY_BUCKETS).labels(*base)
        self._queue = histogram("request_queue_time_seconds",
                                "Histogram of time spent in WAITING phase for request.",
                                VLLM_LATENCY_BUCKETS).labels(*base)
        reg.register(_VllmGauges(cfg, scheduler))

    def observe(self, req: SimRequest, now: float) -> None:
        """Count a finished (or aborted) request under its finished_reason."""
        self._prompt.inc(req.input_tokens)
        self._cache_queries.inc(req.input_tokens)
        self._generation.inc(req.completion_tokens)
        self._success["abort" if req.aborted else req.finish_reason].inc()
        self._prompt_hist.observe(req.input_tokens)
        self._generation_hist.observe(req.completion_tokens)
        self._e2e.observe(now - req.arrival)
        if req.admitted_at is not None:
            self._queue.observe(req.admitted_at - req.arrival)
            if req.completion_tokens:
                self._ttft.observe(req.first_token_at() - req.arrival)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


def build_metrics(cfg: SimConfig, capacity: Capacity, scheduler: Scheduler) -> Metrics | None:
    """The flavour's metrics, or None where /metrics is off or absent (strict)."""
    if not cfg.enable_metrics or cfg.flavor == "strict":
        return None
    if cfg.flavor == "vllm":
        return VllmMetrics(cfg, scheduler)
    return SimMetrics(cfg, capacity, scheduler)
