"""/metrics carries every series vLLM's published Grafana dashboard plots (its queries are checked in as data),
with vLLM's names, types and labels, and the values the requests sent here imply."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serving import metric, running_server

QUERIES = Path(__file__).parent / "data" / "vllm_grafana_queries.txt"
# what vLLM 0.33 also exports and dashboards built on it read, beyond the published dashboard: name -> type
ALSO = {
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
}


def dashboard_series() -> set[str]:
    lines = [line for line in QUERIES.read_text().splitlines() if line and not line.startswith("#")]
    return {name for line in lines for name in re.findall(r"vllm:[a-z0-9_]+", line)}


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_every_dashboard_series_is_exported_with_the_values_of_the_requests(tiny_dirs):
    series = dashboard_series()
    assert len(series) >= 18 and "vllm:request_queue_time_seconds_sum" in series
    with running_server(
        tiny_dirs["tiny-3b"],
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--num-gpu-blocks-override",
        "64",
        "--served-model-name",
        "tiny",
    ) as (base, _):
        for max_tokens in (3, 5):
            reply = httpx.post(
                base + "/v1/completions",
                timeout=60,
                json={"model": "tiny", "prompt": "The harbour at dawn", "max_tokens": max_tokens, "ignore_eos": True},
            )
            assert reply.status_code == 200
        # a finished request's latency events reach the metrics with the engine's next stats message, which may
        # come after its answer (every STATS_EVERY_S): wait for both
        deadline = time.monotonic() + 10
        while metric(base, "vllm:request_prompt_tokens_count") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        text = httpx.get(base + "/metrics").text
    samples = {}
    for family in families(text).values():
        for sample in family.samples:
            if sample.labels.get("model_name") == "tiny":
                samples.setdefault(sample.name, []).append(sample)
    missing = sorted(name for name in series if name not in samples)
    assert not missing, f"series the vLLM dashboard plots that /metrics lacks: {missing}"
    found = families(text)
    for name, kind in {
        **{
            n: "histogram"
            for n in (
                "vllm:request_prompt_tokens",
                "vllm:request_generation_tokens",
                "vllm:time_per_output_token_seconds",
                "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds",
                "vllm:request_decode_time_seconds",
            )
        },
        **ALSO,
    }.items():
        assert found[name].type == kind, name

    def value(name, **labels):
        return sum(s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items()))

    prompt_len = value("vllm:prompt_tokens_total") / 2
    assert value("vllm:request_prompt_tokens_count") == 2 and value("vllm:request_prompt_tokens_sum") == 2 * prompt_len
    assert value("vllm:request_generation_tokens_sum") == 8 == value("vllm:generation_tokens_total")
    assert value("vllm:request_max_num_generation_tokens_sum") == 8 == value("vllm:request_params_max_tokens_sum")
    assert value("vllm:request_params_n_count") == 2 == value("vllm:request_params_n_sum")
    assert value("vllm:request_prefill_kv_computed_tokens_sum") == 2 * prompt_len  # no prefix caching
    assert value("vllm:request_time_per_output_token_seconds_count") == 2
    assert 0 < value("vllm:request_time_per_output_token_seconds_sum") <= value("vllm:request_decode_time_seconds_sum")
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(f"vllm:request_{phase}_time_seconds_count") == 2, phase
    assert value("vllm:request_inference_time_seconds_sum") >= value("vllm:request_decode_time_seconds_sum") > 0
    assert value("vllm:time_per_output_token_seconds_count") == 2 + 4 == value("vllm:inter_token_latency_seconds_count")
    steps = value("vllm:iteration_tokens_total_count")
    assert steps >= 5 and value("vllm:iteration_tokens_total_sum") == 2 * prompt_len + 8 - 2  # the first token
    assert value("vllm:request_success_total", finished_reason="length") == 2
    info = found["vllm:cache_config_info"].samples  # labelled by the settings, not the model (as vLLM's)
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["block_size"] == "16" and info[0].labels["num_gpu_blocks"] == "64"
    assert info[0].labels["cache_dtype"] == "auto" and "lora_requests_info" not in text  # no LoRA here


def test_lora_requests_info_and_the_kv_dtype_as_configured(tiny_dirs):
    """vLLM's lora_requests_info with LoRA on (the adapters of running and waiting requests), and cache_config_info
    says the KV cache's dtype as asked (it said auto under --kv-cache-dtype fp8)."""
    flags = ["--dtype", "float32", "--max-model-len", "256", "--served-model-name", "tiny", "--enable-lora"]
    with running_server(tiny_dirs["tiny-3b"], *flags, "--max-loras", "3", "--kv-cache-dtype", "fp8") as (base, proc):
        reply = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 200
        found = families(httpx.get(base + "/metrics").text)
    (info,) = found["vllm:lora_requests_info"].samples
    assert info.labels == {"max_lora": "3", "waiting_lora_adapters": "", "running_lora_adapters": ""}
    assert found["vllm:cache_config_info"].samples[0].labels["cache_dtype"] == "fp8"
    assert "KV cache: " in proc.output and " tokens of float8_e4m3fn" in proc.output


def test_lora_requests_info_follows_the_adapters_in_use():
    from prometheus_client import generate_latest

    from fovea.core.stats import EngineStats
    from fovea.server.metrics import ServerMetrics

    metrics = ServerMetrics("tiny", 256, max_loras=2)
    metrics.update(EngineStats(running_loras=("a", "b"), waiting_loras=("c",)))
    (info,) = families(generate_latest(metrics.registry).decode())["vllm:lora_requests_info"].samples
    assert (info.labels["running_lora_adapters"], info.labels["waiting_lora_adapters"]) == ("a,b", "c")


def test_inter_token_latencies_fed_a_step_at_once_read_as_prometheus_histograms_do():
    """The inter-token histogram takes a step's latencies in one call (ServerMetrics.update); what /metrics shows
    of it is what prometheus_client's Histogram shows for the same observations, under both names, values on
    a bucket's bound and past the last one included."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from fovea.core.stats import EngineStats, LatencyEvents
    from fovea.server.metrics import ITL_BUCKETS, ServerMetrics

    steps = [[0.01, 0.0099, 0.02, 0.3], [], [0.0001, 80.0, 80.5, 1e6, 0.075]]
    ours = ServerMetrics("m")
    for values in steps:
        ours.update(EngineStats(events=LatencyEvents(inter_token=list(values))))
    reference = CollectorRegistry()
    for name in ("fovea:inter_token_latency_seconds", "fovea:time_per_output_token_seconds"):
        histogram = Histogram(name, "x", ["model_name"], registry=reference, buckets=ITL_BUCKETS).labels("m")
        for value in (v for values in steps for v in values):
            histogram.observe(value)

    def samples(text: str, name: str) -> list:
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
        return sorted(
            (s.name, tuple(sorted(s.labels.items())), s.value) for s in family.samples if "created" not in s.name
        )

    shown = generate_latest(ours.registry).decode()
    expected = generate_latest(reference).decode()
    for name in ("fovea:inter_token_latency_seconds", "fovea:time_per_output_token_seconds"):
        assert samples(shown, name) == samples(expected, name), name
        assert samples(shown, name.replace("fovea:", "vllm:")), name
