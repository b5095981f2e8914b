"""`fovea bench serve`: drives any OpenAI-compatible server with a workload and measures it as vLLM does.

Requests are sent at the configured arrival process (all at once for an infinite rate; otherwise gaps drawn from
gamma(shape=burstiness, scale=1/(rate*burstiness)), burstiness 1 being Poisson), at most --max-concurrency at a
time, each streamed with usage so its chunks can be timed. See metrics.py for what is computed from them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

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


async def arrivals(
    requests: list[BenchRequest], rate: float, burstiness: float, rng: np.random.Generator, ramp_up=(None,) * 3
) -> AsyncIterator[BenchRequest]:
    """Each request, then the gap before the next: gamma-distributed at `rate` (or, ramping up, at the next
    request's rate; none at a rate of 0 or infinity)."""
    for index, request in enumerate(requests):
        yield request
        if ramp_up[0] is not None:
            rate = ramp_rate(index + 1, len(requests), *ramp_up)
        if 0 < rate != float("inf"):
            await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


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
) -> tuple[list[RequestResult], float]:
    """Sends `requests`; returns their results (in order) and the benchmark's duration in seconds. `ramp_up`:
    (linear or exponential, start and end rates) in place of `request_rate`."""
    try:
        import aiohttp
    except ImportError:
        raise ValueError("fovea bench serve needs aiohttp: pip install 'fovea[bench]'") from None
    if burstiness <= 0 or (request_rate <= 0 and ramp_up[0] is None):
        raise ValueError("--request-rate and --burstiness must be positive")
    url = base_url.rstrip("/") + endpoint
    headers = headers or {}
    bodies = [request_body(r, endpoint, model, extra_body or {}, ignore_eos, logprobs) for r in requests]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False)
    bar = _progress(len(requests)) if progress else None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=True) as session:
        warmups = [send(session, url, bodies[0], headers, RequestResult()) for _ in range(num_warmups)]
        for warm in await asyncio.gather(*warmups):
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")

        async def one(index: int) -> RequestResult:
            result = RequestResult(requests[index].prompt_len, requests[index].output_len)
            own = headers if request_id_prefix is None else {**headers, "x-request-id": f"{request_id_prefix}{index}"}
            if limit is None:
                await send(session, url, bodies[index], own, result)
            else:
                async with limit:
                    await send(session, url, bodies[index], own, result)
            if bar is not None:
                bar.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        index = 0
        async for _ in arrivals(requests, request_rate, burstiness, np.random.default_rng(seed), ramp_up):
            tasks.append(asyncio.create_task(one(index)))
            index += 1
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), duration


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Requests", dynamic_ncols=True)
