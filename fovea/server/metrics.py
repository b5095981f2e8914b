"""GET /metrics: Prometheus metrics named like vLLM's, each under both prefixes, `fovea:` and `vllm:` (so that
dashboards and alerts written for vLLM work unchanged).

Fed by the engine's stats (EngineStats), which arrive with every step's outputs: gauges are set to the
snapshot, totals advance by what changed since the previous one, latency events go into histograms.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from fovea.core.stats import EngineStats

# the buckets vLLM uses, so dashboards built for it read the same
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]  # also the request phases' (queue, prefill, decode, inference)
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (token-count histograms, as vLLM buckets them)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# running totals in EngineStats -> the counter each one feeds
TOTALS = {
    "prefix_cache_queries": ("fovea:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("fovea:prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "encoder_cache_queries": ("fovea:encoder_cache_queries", "Images the engine needed encoder outputs for"),
    "encoder_cache_hits": ("fovea:encoder_cache_hits", "Images whose encoder outputs were already cached"),
    "num_preemptions": ("fovea:num_preemptions", "Sequences preempted for lack of KV blocks"),
}


class _BothPrefixes:
    """Collects the `fovea:` families of `source`, and each again renamed to `vllm:`."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self):
        for family in self.source.collect():
            yield family
            twin = Metric(family.name.replace("fovea:", "vllm:", 1), family.documentation, family.type, family.unit)
            twin.samples = [
                sample._replace(name=sample.name.replace("fovea:", "vllm:", 1)) for sample in family.samples
            ]
            yield twin


class _ProcessorCacheCounters:
    def __init__(self, cache, model_name: str):
        self.cache, self.model_name = cache, model_name

    def collect(self):
        for name, documentation, value in (
            ("fovea:mm_cache_queries", "Images and videos looked up in the processor cache", self.cache.queries),
            ("fovea:mm_cache_hits", "Images and videos found decoded in the processor cache", self.cache.hits),
        ):
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class _InterTokenLatency:
    """The inter-token latency histogram, under vLLM's two names for it (its Grafana dashboard plots
    time_per_output_token), fed a step's latencies at once: a step's two locked `Histogram.observe` calls per
    token took ~1.2 us a token in the front end's receiving thread, bucketing them with numpy ~0.04 us
    (benchmarks/README)."""

    NAMES = ("fovea:inter_token_latency_seconds", "fovea:time_per_output_token_seconds")

    def __init__(self, model_name: str, buckets: list[float]):
        self.model_name = model_name
        self.bounds = np.array(buckets)
        self.les = [floatToGoString(b) for b in buckets] + ["+Inf"]
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)
        self.sum = 0.0
        self.lock = threading.Lock()  # fed by the receiving thread, read by a scrape on the event loop

    def observe_all(self, values: list[float]) -> None:
        if not values:
            return
        # a value's bucket is the first bound at or above it ("le"); past the last bound: +Inf
        counts = np.bincount(np.searchsorted(self.bounds, values), minlength=len(self.counts))
        with self.lock:
            self.counts += counts
            self.sum += sum(values)

    def collect(self):
        with self.lock:
            cumulative, total = np.cumsum(self.counts).tolist(), self.sum
        for name in self.NAMES:
            family = HistogramMetricFamily(name, "Between a sequence's tokens", labels=["model_name"])
            family.add_metric([self.model_name], list(zip(self.les, cumulative)), total)
            yield family


class ServerMetrics:
    def __init__(
        self, model_name: str, max_model_len: int = 1 << 20, cache_config: dict | None = None, max_loras: int = 0
    ):
        """`cache_config`: labels of the cache_config_info series (block_size, gpu_memory_utilization, ...);
        `max_loras`: with LoRA on, the lora_requests_info series."""
        own = self._own = CollectorRegistry()
        self.registry = CollectorRegistry()  # what /metrics shows: `own`, under both prefixes
        self.registry.register(_BothPrefixes(own))
        self.model_name = model_name
        label = {"model_name": model_name}

        def make(kind, name, documentation, labels=(), **kwargs):
            metric = kind(name, documentation, ["model_name", *labels], registry=own, **kwargs)
            return metric if labels else metric.labels(**label)

        self.finished = make(
            Counter, "fovea:request_success", "Finished requests by finish reason", ["finished_reason"]
        )
        self.finished_by_reason = lambda reason: self.finished.labels(finished_reason=reason, **label)
        self.prompt_tokens = make(Counter, "fovea:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = make(Counter, "fovea:generation_tokens", "Tokens generated for finished requests")
        self.ttft = make(
            Histogram, "fovea:time_to_first_token_seconds", "From arrival to the first token", buckets=TTFT_BUCKETS
        )
        self.inter_token = _InterTokenLatency(model_name, ITL_BUCKETS)
        own.register(self.inter_token)
        self.end_to_end = make(
            Histogram, "fovea:e2e_request_latency_seconds", "From arrival to finish", buckets=E2E_BUCKETS
        )
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = make(
            Histogram, "fovea:request_prompt_tokens", "Prompt tokens per request", buckets=token_buckets
        )
        self.request_generation_tokens = make(
            Histogram, "fovea:request_generation_tokens", "Generated tokens per request", buckets=token_buckets
        )
        self.request_max_tokens = make(
            Histogram,
            "fovea:request_max_num_generation_tokens",
            "max_tokens asked for per request",
            buckets=token_buckets,
        )
        self.request_params_max_tokens = make(
            Histogram, "fovea:request_params_max_tokens", "The max_tokens request parameter", buckets=token_buckets
        )
        self.request_params_n = make(
            Histogram, "fovea:request_params_n", "The n request parameter", buckets=[1, 2, 5, 10, 20]
        )
        self.request_prefill_computed = make(
            Histogram,
            "fovea:request_prefill_kv_computed_tokens",
            "Prompt tokens computed in prefill (the cached ones left out)",
            buckets=token_buckets,
        )
        self.request_time_per_output_token = make(
            Histogram,
            "fovea:request_time_per_output_token_seconds",
            "A request's decode time per output token after its first",
            buckets=ITL_BUCKETS,
        )
        self.lora_info = None
        if max_loras:  # as vLLM: only with LoRA on
            self.lora_info = Gauge(
                "fovea:lora_requests_info",
                "LoRA adapters of running and waiting requests (labels; the value is the time they were read)",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=own,
            )
            self.max_loras = max_loras
            self._show_loras((), ())
        self.phases = {
            phase: make(Histogram, f"fovea:request_{phase}_time_seconds", doc, buckets=E2E_BUCKETS)
            for phase, doc in (
                ("queue", "From arrival to first scheduled"),
                ("prefill", "From first scheduled to the first token"),
                ("decode", "From the first token to the last"),
                ("inference", "From first scheduled to the last token"),
            )
        }
        self.iteration_tokens = make(
            Histogram, "fovea:iteration_tokens_total", "Tokens per engine step", buckets=ITERATION_TOKEN_BUCKETS
        )
        self.cache_config = {key: str(value) for key, value in (cache_config or {}).items()}
        self.cache_info = Gauge(
            "fovea:cache_config_info",
            "The KV cache's settings (labels; value 1)",
            [*self.cache_config, "num_gpu_blocks"],
            registry=own,
        )
        self.running = make(Gauge, "fovea:num_requests_running", "Requests in the running batch")
        self.waiting = make(Gauge, "fovea:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = make(Gauge, "fovea:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.gpu_cache_usage = make(
            Gauge,
            "fovea:gpu_cache_usage_perc",
            "Fraction of KV blocks in use (0-1; vLLM's older name, which dashboards plot)",
        )
        self.kv_used_blocks = make(Gauge, "fovea:kv_cache_used_blocks", "KV blocks held by sequences")
        self.kv_total_blocks = make(Gauge, "fovea:kv_cache_total_blocks", "KV blocks in the cache")
        self.encoder_references = make(
            Gauge, "fovea:encoder_cache_references", "Image embeddings held in the encoder cache for running sequences"
        )
        self.cache_gauges = {  # EngineStats field -> gauge: what the engine's caches hold, against their bounds
            key: make(Gauge, name, doc)
            for key, name, doc in (
                (
                    "encoder_cache_tokens",
                    "fovea:encoder_cache_used_tokens",
                    "Image-embedding rows the encoder cache holds",
                ),
                ("encoder_cache_capacity", "fovea:encoder_cache_capacity_tokens", "The encoder cache's bound, in rows"),
                ("loras_held", "fovea:lora_adapters_held", "LoRA adapters whose weights the engine holds"),
            )
        }
        self.totals = {key: make(Counter, name, doc) for key, (name, doc) in TOTALS.items()}
        # data-parallel servers: the same figures per replica, labelled replica="0", "1", ...
        self.per_replica = {
            key: make(Gauge, f"fovea:replica_{key}", doc, ["replica"])
            for key, doc in (
                ("num_requests_running", "Requests in the replica's running batch"),
                ("num_requests_waiting", "Requests waiting in the replica"),
                ("kv_cache_usage_perc", "Fraction of the replica's KV blocks in use (0-1)"),
                ("requests_added", "Requests sent to the replica since it started"),
                ("up", "1 while the replica serves, 0 while it is down (its process or host lost; restarting)"),
            )
        }
        self.last = EngineStats()
        for reason in ("stop", "length", "abort", "error"):
            self.finished_by_reason(reason)  # present at zero before the first request

    def _show_loras(self, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        self.lora_info.clear()
        labels = dict(waiting_lora_adapters=",".join(waiting), running_lora_adapters=",".join(running))
        self.lora_info.labels(max_lora=str(self.max_loras), **labels).set(time.time())

    def watch_processor_cache(self, cache) -> None:
        """The front end's multimodal processor cache (multimodal/processor_cache.py), read at each scrape."""
        self._own.register(_ProcessorCacheCounters(cache, self.model_name))

    def update(self, stats: EngineStats) -> None:
        """Called from the thread that receives the engine's results (prometheus_client is thread-safe)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.gpu_cache_usage.set(stats.kv_usage)
        if stats.kv_total_blocks and self.last.kv_total_blocks != stats.kv_total_blocks:  # known once it started
            self.cache_info.clear()
            self.cache_info.labels(**self.cache_config, num_gpu_blocks=str(stats.kv_total_blocks)).set(1)
        self.kv_used_blocks.set(stats.kv_used_blocks)
        self.kv_total_blocks.set(stats.kv_total_blocks)
        self.encoder_references.set(stats.encoder_cache_references)
        for key, gauge in self.cache_gauges.items():
            gauge.set(getattr(stats, key))
        for replica, own in enumerate(stats.replicas):
            values = (own.num_running, own.num_waiting, own.kv_usage, own.num_requests_added, int(own.serving))
            for gauge, value in zip(self.per_replica.values(), values):
                gauge.labels(model_name=self.model_name, replica=str(replica)).set(value)
        for key, counter in self.totals.items():
            now, before = getattr(stats, key), getattr(self.last, key)
            counter.inc(now - before if now >= before else now)  # a restarted engine counts from 0 again
        loras = (stats.running_loras, stats.waiting_loras)
        if self.lora_info is not None and loras != (self.last.running_loras, self.last.waiting_loras):
            self._show_loras(*loras)
        self.last = stats
        events = stats.events
        for value in events.time_to_first_token:
            self.ttft.observe(value)
        self.inter_token.observe_all(events.inter_token)
        for histogram, values in (
            (self.request_prompt_tokens, events.request_prompt_tokens),
            (self.request_generation_tokens, events.request_generation_tokens),
            (self.request_max_tokens, events.request_max_tokens),
            (self.request_params_max_tokens, events.request_max_tokens),
            (self.request_params_n, events.request_n),
            (self.request_prefill_computed, events.request_prefill_computed),
            (self.request_time_per_output_token, events.request_time_per_output_token),
            (self.iteration_tokens, events.iteration_tokens),
            *((self.phases[phase], events.phases[phase]) for phase in self.phases),
        ):
            for value in values:
                histogram.observe(value)
        for value in events.end_to_end:
            self.end_to_end.observe(value)
        for reason, count in events.finished.items():
            self.finished_by_reason(reason).inc(count)
        self.prompt_tokens.inc(sum(events.request_prompt_tokens))
        self.generation_tokens.inc(sum(events.request_generation_tokens))
