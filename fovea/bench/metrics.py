"""Serving-benchmark metrics, defined as `vllm bench serve` defines them, so numbers compare one to one.

Per request (client clock): TTFT = send -> first chunk carrying choices; ITL = gaps between later chunks;
E2EL = send -> last chunk; TPOT = (E2EL - TTFT) / (output tokens - 1), for outputs of more than one token.
Output tokens come from the stream's usage chunk, and so do input tokens where the server counts them (chat
template and image tokens included; else the dataset's text length, as vLLM's client falls back). Throughputs
divide totals by the benchmark's duration; peak output tokens/s counts chunks in 1-second buckets and peak
concurrency the most requests running at one instant; goodput counts the requests meeting every SLO given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
    # with --max-concurrency: the wait for a free slot before sending, and E2EL with it (at a finite rate)
    "client_queue_time": ("Client-side Queueing", "Client Queue Time"),
    "e2el_including_client_queue": ("Queue-inclusive End-to-end Latency", "E2EL incl. Client Queue"),
}


@dataclass
class RequestResult:
    prompt_len: int = 0
    expected_output_len: int = 0
    start_time: float = 0.0  # perf_counter at send
    success: bool = False
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL, seconds
    output_tokens: int | None = None  # from the usage chunk
    generated_text: str = ""
    error: str = ""
    queue_time: float = 0.0  # arrival -> send: the wait for a --max-concurrency slot

    @property
    def tpot(self) -> float | None:
        tokens = self.output_tokens or 0
        return (self.latency - self.ttft) / (tokens - 1) if tokens > 1 else None


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput value must be a number of milliseconds, got {item!r}") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput value must not be negative, got {item!r}")
    return slos


def chunks_per_second(results: list[RequestResult]) -> np.ndarray:
    """Chunks received in each 1-second bucket from the first send."""
    done = [r for r in results if r.success]
    if not done:
        return np.zeros(1)
    first = min(r.start_time for r in done)
    times = [t for r in done for t in r.start_time + r.ttft + np.cumsum([0.0, *r.itl])]
    return np.bincount((np.asarray(times) - first).astype(int))


def peaks(results: list[RequestResult]) -> tuple[float, int]:
    """(most chunks in one 1-second bucket from the first send, most requests running at one instant)."""
    done = [r for r in results if r.success]
    if not done:
        return 0.0, 0
    # a request runs over [send, last chunk): at equal times an end comes before a start
    events = sorted([(r.start_time, 1) for r in done] + [(r.start_time + r.latency, -1) for r in done])
    return float(chunks_per_second(done).max()), int(max(np.cumsum([change for _, change in events])))


def compute_metrics(
    results: list[RequestResult],
    duration: float,
    goodput: dict[str, float] | None = None,
    selected: tuple[str, ...] = ("ttft", "tpot", "itl"),
    percentiles: tuple[float, ...] = (99,),
    queued: tuple[bool, bool] = (False, False),
) -> dict:
    """The result dict with vLLM's field names; latencies in milliseconds. `queued`: whether the client queued
    requests (--max-concurrency) and sent them at a finite rate: the queue's metrics are reported then."""
    done = [r for r in results if r.success]
    values = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    if queued[0] and "client_queue_time" in selected:
        values["client_queue_time"] = [r.queue_time for r in done]
    if all(queued) and "e2el_including_client_queue" in selected:
        values["e2el_including_client_queue"] = [r.latency + r.queue_time for r in done]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens or 0 for r in done)
    good = 0
    if goodput:
        for r in done:
            mine = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
            good += all(mine[name] * 1000 <= limit for name, limit in goodput.items())
    peak_tokens, peak_running = peaks(results)
    metrics = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_running,
    }
    for name in values:
        ms = np.asarray(values[name] or [0.0]) * 1000
        metrics[f"mean_{name}_ms"] = float(ms.mean())
        metrics[f"median_{name}_ms"] = float(np.median(ms))
        metrics[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles if name in selected else ():
            metrics[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return metrics


def format_table(
    metrics: dict, selected: tuple[str, ...], percentiles: tuple[float, ...], max_concurrency: int | None = None
) -> str:
    """The "Serving Benchmark Result" block, row for row as vLLM prints it."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name, value, digits=2):
        lines.append(f"{name:<40} {value:<10.{digits}f}" if isinstance(value, float) else f"{name:<40} {value:<10}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", metrics["duration"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    if metrics["request_goodput"] is not None:
        row("Request goodput (req/s):", metrics["request_goodput"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"])
    row("Peak concurrent requests:", metrics["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", metrics["total_token_throughput"])
    for name in (name for name in selected if f"mean_{name}_ms" in metrics):
        title, short = METRIC_TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", metrics[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", metrics[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", metrics[f"p{p:g}_{name}_ms"])
    if "probe_completed" in metrics:
        lines.append("{s:{c}^{n}}".format(s="Probe Requests", n=50, c="-"))
        row("Probe requests completed:", metrics["probe_completed"])
        row("Probe requests failed:", metrics["probe_failed"])
        for name in ("median", "p99", "max"):
            row(f"{name.capitalize() if name != 'p99' else 'P99'} probe E2EL (ms):", metrics[f"probe_{name}_e2el_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def probe_metrics(probes: list[RequestResult]) -> dict:
    """--probe-request-rate's figures (vLLM's names): how many probes completed and their E2EL, in ms."""
    ms = np.asarray([r.latency for r in probes if r.success]) * 1000
    if not len(ms):
        return {}
    return {
        "probe_completed": len(ms),
        "probe_failed": len(probes) - len(ms),
        "probe_median_e2el_ms": float(np.median(ms)),
        "probe_p99_e2el_ms": float(np.percentile(ms, 99)),
        "probe_max_e2el_ms": float(ms.max()),
    }
