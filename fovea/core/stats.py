"""What the engine reports about itself: a snapshot of its state plus the latency events since the last one.

The engine records events as they happen (a request's first token, each later token, a request finishing);
`EngineStats` carries them out of the engine process with the gauges and running totals, and the server turns
them into Prometheus metrics. Latencies are measured from the request's arrival at the front end.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class LatencyEvents:
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    end_to_end: list[float] = field(default_factory=list)
    finished: Counter = field(default_factory=Counter)  # finish reason -> requests
    # one entry per finished request: its token counts, the max_tokens it asked for, and the phases of its life
    # (queued: arrival to first scheduled; prefill: to the first token; decode: first to last token; inference:
    # first scheduled to last token), in seconds
    request_prompt_tokens: list[int] = field(default_factory=list)
    request_generation_tokens: list[int] = field(default_factory=list)
    request_max_tokens: list[int] = field(default_factory=list)
    request_n: list[int] = field(default_factory=list)
    request_prefill_computed: list[int] = field(default_factory=list)  # prompt tokens not found in the cache
    request_time_per_output_token: list[float] = field(default_factory=list)  # its decode time per token after one
    phases: dict[str, list[float]] = field(
        default_factory=lambda: {"queue": [], "prefill": [], "decode": [], "inference": []}
    )
    iteration_tokens: list[int] = field(default_factory=list)  # tokens of each engine step

    def add_finished(self, request) -> None:
        """A request that finished (or was aborted): its latency, finish reason, token counts and phases."""
        times = request.metrics
        self.end_to_end.append(time.time() - times.arrival_time)
        self.finished["abort" if request.aborted else request.sequences[0].finish_reason] += 1
        self.request_prompt_tokens.append(len(request.prompt_token_ids))
        self.request_generation_tokens.append(sum(seq.num_output_tokens for seq in request.sequences))
        if request.params.max_tokens is not None:
            self.request_max_tokens.append(request.params.max_tokens)
        self.request_n.append(request.params.n)
        self.request_prefill_computed.append(len(request.prompt_token_ids) - request.num_cached_tokens)
        generated = self.request_generation_tokens[-1]
        if generated > 1 and times.first_token_time is not None and times.last_token_time is not None:
            self.request_time_per_output_token.append(
                (times.last_token_time - times.first_token_time) / (generated - 1)
            )
        for phase, start, end in (
            ("queue", times.arrival_time, times.first_scheduled_time),
            ("prefill", times.first_scheduled_time, times.first_token_time),
            ("decode", times.first_token_time, times.last_token_time),
            ("inference", times.first_scheduled_time, times.last_token_time),
        ):
            if start is not None and end is not None:  # an aborted request may not have reached a phase
                self.phases[phase].append(end - start)


@dataclass
class EngineStats:
    num_running: int = 0  # requests with a sequence running
    num_waiting: int = 0  # requests with a sequence waiting (for the first time, or again after preemption)
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, found cached
    encoder_cache_queries: int = 0  # images the engine needed encoded, since start
    encoder_cache_hits: int = 0  # of those, found already encoded
    num_preemptions: int = 0
    encoder_cache_references: int = 0  # image embeddings held for running sequences (0 when idle)
    events: LatencyEvents = field(default_factory=LatencyEvents)
    num_requests_added: int = 0  # since start
    replicas: list[EngineStats] = field(default_factory=list)  # data-parallel servers: each replica's own
    serving: bool = True  # a data-parallel replica's, as the front end knows it: False while it is down
    running_loras: tuple[str, ...] = ()  # LoRA adapters of running and of waiting requests (vLLM's lora_requests_info)
    waiting_loras: tuple[str, ...] = ()
    # what the engine's caches hold, against their bounds (a soak checks them: benchmarks/soak.py)
    encoder_cache_tokens: int = 0  # image-embedding rows cached, referenced or not
    encoder_cache_capacity: int = 0
    loras_held: int = 0  # adapters whose weights rank 0 holds (at most max_cpu_loras)

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


def combine(replicas: list[EngineStats], events: LatencyEvents) -> EngineStats:
    """Data-parallel replicas' latest gauges and totals summed, with the latency events of one new report."""
    total = EngineStats(events=events)
    for stats in replicas:
        for name in (
            "num_running",
            "num_waiting",
            "kv_used_blocks",
            "kv_total_blocks",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "encoder_cache_queries",
            "encoder_cache_hits",
            "num_preemptions",
            "encoder_cache_references",
            "num_requests_added",
            "encoder_cache_tokens",
            "encoder_cache_capacity",
            "loras_held",
        ):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
        total.running_loras = tuple(dict.fromkeys(total.running_loras + stats.running_loras))
        total.waiting_loras = tuple(dict.fromkeys(total.waiting_loras + stats.waiting_loras))
    total.replicas = list(replicas)
    return total


def record_token_time(seq, now: float, events: LatencyEvents | None) -> None:
    """An engine Sequence's token came at `now`: its request's first and last token times, and the latency events."""
    metrics = seq.request.metrics
    if events is not None:
        if metrics.first_token_time is None:
            events.time_to_first_token.append(now - metrics.arrival_time)
        elif seq.last_token_time is not None:  # a fork's first token follows no token of its own
            events.inter_token.append(now - seq.last_token_time)
    metrics.first_token_time = metrics.first_token_time or now
    metrics.last_token_time = seq.last_token_time = now
