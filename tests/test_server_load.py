"""Front-end work must not stall generation: while 8 requests with 3000x2000 JPEGs arrive (each a ~2 MB body to
parse, base64 to decode, 6 megapixels to decode and resize), the streams already running keep their pace."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import multiprocessing
import signal
import threading
import time

import httpx
import numpy as np
from conftest import jpeg_bytes
from PIL import Image
from serving import running_server

# the bound asserted on the running streams' largest inter-chunk gap while the images arrive: with the test alone
# the gaps were at most 67-95 ms; under the whole suite's load on the 2-core machine (both cores busy) runs saw
# 636 ms and 1125 ms
MAX_GAP_S = 2.0


def photo_like(width: int, height: int, seed: int) -> Image.Image:
    """Smooth gradients plus mild noise: JPEG-compresses like a photo (~1-2 MB at 3000x2000), unlike pure noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    base += rng.normal(0, 12, size=(height // 8, width // 8, 1)).repeat(8, 0).repeat(8, 1)
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def stream_chunk_times(base: str, prompt: str, times: list[float], stop: threading.Event) -> None:
    """Reads a long stream, noting when each chunk arrives, until `stop` is set."""
    body = {"prompt": prompt, "max_tokens": 1800, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
            if stop.is_set():
                return


def post_concurrently(base: str, bodies: list[str]) -> list[int]:
    def post(body):
        return httpx.post(
            base + "/v1/chat/completions", content=body, timeout=120, headers={"content-type": "application/json"}
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


def test_large_image_arrivals_do_not_stall_running_streams(tiny_dirs):
    bodies = []
    for i in range(8):
        url = "data:image/jpeg;base64," + base64.b64encode(jpeg_bytes(photo_like(3000, 2000, i))).decode()
        bodies.append(
            json.dumps(
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": url}},
                                {"type": "text", "text": "Describe it."},
                            ],
                        }
                    ],
                    "max_tokens": 2,
                    "temperature": 0,
                    # the front end still decodes all 6 megapixels; the engine gets a 16-token image
                    "mm_processor_kwargs": {"max_pixels": 28 * 28 * 16},
                }
            )
        )
    with running_server(
        tiny_dirs["tiny-3b"], "--dtype", "float32", "--max-model-len", "2048", "--num-gpu-blocks-override", "400"
    ) as (base, server):
        streams, stop = [[] for _ in range(2)], threading.Event()
        threads = [
            threading.Thread(target=stream_chunk_times, args=(base, f"Stream {i} is about", times, stop))
            for i, times in enumerate(streams)
        ]
        for thread in threads:
            thread.start()
        while min(len(t) for t in streams) < 20:  # both streams are decoding
            time.sleep(0.01)
        # the sender runs in another process, so its work cannot delay this one's reading of the streams
        with concurrent.futures.ProcessPoolExecutor(1, multiprocessing.get_context("spawn")) as sender:
            sender.submit(time.sleep, 0).result()  # started before the window opens
            window_start = time.perf_counter()
            statuses = sender.submit(post_concurrently, base, bodies).result()
            window_end = time.perf_counter()
        time.sleep(0.5)
        stop.set()
        for thread in threads:
            thread.join()
        # SIGTERM while a stream runs: the stream still finishes whole, then the server exits cleanly
        body = {"prompt": "Last words", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            server.send_signal(signal.SIGTERM)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert server.returncode == 0 and "terminate called" not in server.output, server.output
    assert statuses == [200] * 8
    assert all(t[-1] > window_end for t in streams)
    before, during = [], []
    for times in streams:
        for previous, current in zip(times, times[1:]):
            gap = current - previous
            if current < window_start:
                before.append(gap)
            elif previous < window_end:
                during.append(gap)
    print(
        f"\nimage arrivals took {window_end - window_start:.2f} s; inter-chunk gap before: median "
        f"{np.median(before) * 1e3:.1f} ms, max {max(before) * 1e3:.1f} ms; during: median "
        f"{np.median(during) * 1e3:.1f} ms, max {max(during) * 1e3:.1f} ms"
    )
    assert max(during) < MAX_GAP_S
