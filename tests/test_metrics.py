"""/metrics carries every series vLLM's published Grafana dashboard plots (its queries are checked in as data),
with vLLM's names, types and labels, and the values the requests sent here imply."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serving import running_server

QUERIES = Path(__file__).parent / "data" / "vllm_grafana_queries.txt"
# what vLLM 0.33 also exports and dashboards built on it read, beyond the published dashboard: name -> type
ALSO = {
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:kv_cache_usage_perc": "gauge",
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
    assert value("vllm:request_max_num_generation_tokens_sum") == 8
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
