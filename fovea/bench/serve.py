"""`fovea bench serve`: drives any OpenAI-compatible server with a workload and measures it as vLLM does.

Requests are sent at times drawn up front (send_times: all at once for an infinite rate; otherwise gaps drawn
from gamma(shape=burstiness, scale=1/(rate*burstiness)), burstiness 1 being Poisson), at most --max-concurrency at
a time, each streamed with usage so its chunks can be timed. See metrics.py for what is computed from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import numpy as np

from fovea.bench.datasets import BenchRequest
from fovea.bench.metrics import RequestResult


def request_body(
    request: BenchRequest, endpoint: str, model: str, extra_body: dict, ignore_eos: bool, logprobs: int | None = None
) -> dict:
    """The body vLLM's bench client sends: no sampling fields but those given (`extra_body`: --temperature,
    --top-p, ..., --extra-body), so the server's generation_config defaults apply as they do for vLLM's client."""
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    if endpoint.endswith("/chat/completions"):
        content = [{"type": "text", "text": request.prompt}]
        content += [{"type": "image_url", "image_url": {"url": url}} for url in request.images]
        content += [{"type": "video_url", "video_url": {"url": url}} for url in request.videos]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_completion_tokens": request.output_len,
            **stream,
        }
        if logprobs is not None:
            body.update(logprobs=True, top_logprobs=logprobs)
    elif request.images or request.videos:
        raise ValueError("images and videos need --backend openai-chat (--endpoint /v1/chat/completions)")
    else:
        body = {
            "model": model,
            "prompt": request.prompt,
            "repetition_penalty": 1.0,
            "max_tokens": request.output_len,
            "logprobs": logprobs,
            **stream,
        }
    if ignore_eos:
        body["ignore_eos"] = True
    return {**body, **extra_body}


async def send(session, url: str, body: dict, headers: dict, result: RequestResult) -> RequestResult:
    """Streams one request, timing every chunk that carries choices."""
    result.start_time = start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    continue
                data = json.loads(payload)
                now = time.perf_counter()
                if data.get("choices"):
                    choice = data["choices"][0]
                    text = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                    if not result.ttft:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.generated_text += text or ""
                elif data.get("usage"):
                    result.output_tokens = data["usage"].get("completion_tokens")
                    if data["usage"].get("prompt_tokens") is not None:  # image tokens and template included
                        result.prompt_len = data["usage"]["prompt_tokens"]
        result.latency = last - start
        result.success = result.ttft > 0
        if not result.success:
            result.error = "the stream held no chunk with choices"
    except Exception as error:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(error).__name__}: {error}"
    return result


def ramp_rate(index: int, total: int, strategy: str, start: float, end: float) -> float:
    """vLLM's ramp-up: the rate of the `index`-th request of `total`, from `start` to `end` linearly or
    exponentially in its place among them."""
    progress = index / max(total - 1, 1)
    if strategy == "linear":
        return start + (end - start) * progress
    return start * (end / start) ** progress


def send_times(total: int, rate: float, burstiness: float, rng: np.random.Generator, ramp_up=(None,) * 3) -> list:
    """When each request is sent, in seconds from the start, as vLLM's client schedules them: the gap before each
    gamma-distributed at its rate (or, ramping up, at its own place's rate; constant at 1/rate for an infinite
    burstiness; none at an infinite rate), summed, and at a fixed rate stretched so the last is sent at
    total/rate (the draws' sum is 1-2 % off it, which moved throughput between seeds)."""
    gaps = []
    for index in range(total):
        current = rate if ramp_up[0] is None else ramp_rate(index, total, *ramp_up)
        if current == float("inf"):
            gaps.append(0.0)
        elif burstiness == float("inf"):
            gaps.append(1.0 / current)
        else:
            gaps.append(rng.gamma(shape=burstiness, scale=1.0 / (current * burstiness)))
    times = np.cumsum(gaps)
    if ramp_up[0] is None and total and times[-1] > 0:
        times *= total / rate / times[-1]
    return times.tolist()


def lora_names(total: int, modules: list[str] | None, assignment: str, rng: np.random.Generator) -> list:
    """The model each request names: one of --lora-modules per request, at random or in turn (vLLM's
    --lora-assignment); None where no modules are given (the served model)."""
    if not modules:
        return [None] * total
    if assignment == "round-robin":
        return [modules[i % len(modules)] for i in range(total)]
    return [modules[i] for i in rng.integers(len(modules), size=total)]


async def probe(session, url: str, body: dict, headers: dict, rate: float, stop: asyncio.Event) -> list:
    """--probe-request-rate: one-token text requests, one after another at `rate` (never more than one in flight,
    outside --max-concurrency) until `stop`: how long a small request waits behind the workload."""
    results = []
    while not stop.is_set():
        results.append(await send(session, url, body, headers, RequestResult(1, 1)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0 / rate)
    return results


async def run(
    requests: list[BenchRequest],
    base_url: str,
    endpoint: str,
    model: str,
    *,
    request_rate: float,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    extra_body: dict | None = None,
    ignore_eos: bool = False,
    num_warmups: int = 0,
    headers: dict | None = None,
    seed: int = 0,
    progress: bool = True,
    logprobs: int | None = None,
    request_id_prefix: str | None = None,
    ramp_up: tuple = (None, None, None),
    lora_modules: list[str] | None = None,
    lora_assignment: str = "random",
    probe_rate: float = 0.0,
    verify_ssl: bool = True,
) -> tuple[list[RequestResult], float, list[RequestResult]]:
    """Sends `requests`; returns their results (in order), the benchmark's duration in seconds and the probes'
    results. `ramp_up`: (linear or exponential, start and end rates) in place of `request_rate`."""
    try:
        import aiohttp
    except ImportError:
        raise ValueError("fovea bench serve needs aiohttp: pip install 'fovea[bench]'") from None
    if burstiness <= 0 or (request_rate <= 0 and ramp_up[0] is None) or probe_rate < 0:
        raise ValueError("--request-rate and --burstiness must be positive (--probe-request-rate not negative)")
    url = base_url.rstrip("/") + endpoint
    headers = headers or {}
    rng = np.random.default_rng(seed)
    names = lora_names(len(requests), lora_modules, lora_assignment, np.random.default_rng([seed, 1]))
    bodies = [
        request_body(r, endpoint, name or model, extra_body or {}, ignore_eos, logprobs)
        for r, name in zip(requests, names)
    ]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False, ssl=None if verify_ssl else False)
    bar = _progress(len(requests)) if progress else None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=True) as session:
        warmups = [send(session, url, bodies[0], headers, RequestResult()) for _ in range(num_warmups)]
        for warm in await asyncio.gather(*warmups):
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")

        async def one(index: int) -> RequestResult:
            result = RequestResult(requests[index].prompt_len, requests[index].output_len)
            own = headers if request_id_prefix is None else {**headers, "x-request-id": f"{request_id_prefix}{index}"}
            arrived = time.perf_counter()
            if limit is None:
                await send(session, url, bodies[index], own, result)
            else:
                async with limit:
                    await send(session, url, bodies[index], own, result)
            result.queue_time = result.start_time - arrived
            if bar is not None:
                bar.update(1)
            return result

        stop = asyncio.Event()
        small = BenchRequest("Hi", 1, 1)
        probes = (
            asyncio.create_task(
                probe(session, url, request_body(small, endpoint, model, {}, False), headers, probe_rate, stop)
            )
            if probe_rate
            else None
        )
        tasks = []
        start = time.perf_counter()
        for index, at in enumerate(send_times(len(requests), request_rate, burstiness, rng, ramp_up)):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(index)))
        results = await asyncio.gather(*tasks)
        stop.set()
        probed = await probes if probes else []
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration, probed


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Requests", dynamic_ncols=True)
