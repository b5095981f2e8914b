"""Does one client's large-but-legal request hold up the others? (issue 30.5)

Against a running `fovea serve` (started with --trust-request-chat-template for the `sandbox_parts` probe), sends
K copies of one probe at once while polling /health every 20 ms and sending a plain 4-token chat every 100 ms;
prints the probe's statuses, its wall time, the worst /health wait and the worst plain-chat time. Run py-spy
(`py-spy record --threads -f raw -p PID`) on the server and engine processes beside it to see where time goes.

    python benchmarks/loop_probe.py --base-url http://127.0.0.1:8123 -k 2 chat_logprobs echo_logprobs
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import threading
import time
import urllib.error
import urllib.request

VOCAB = 151000
PLAIN = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HI = [{"role": "user", "content": "hi"}]


def big_jpeg() -> str:
    import numpy as np
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (3000, 4000, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def text_parts(count: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "a"}] * count}]


PROBES = {  # name -> (path, body builder)
    "many_parts": ("/v1/chat/completions", lambda: {"messages": text_parts(150_000), "max_tokens": 1}),
    "huge_parts": ("/v1/chat/completions", lambda: {"messages": text_parts(1_900_000), "max_tokens": 1}),
    "parts_95k": ("/v1/chat/completions", lambda: {"messages": text_parts(95_000), "max_tokens": 1}),
    "many_messages": ("/v1/chat/completions", lambda: {"messages": HI * 150_000, "max_tokens": 1}),
    "echo_logprobs": (
        "/v1/completions",
        lambda: {
            "prompt": [random.randrange(1000, VOCAB) for _ in range(8000)],
            "echo": True,
            "logprobs": 20,
            "max_tokens": 1,
        },
    ),
    "chat_logprobs": (
        "/v1/chat/completions",
        lambda: {"messages": HI, "logprobs": True, "top_logprobs": 20, "n": 8, "max_tokens": 1000, "ignore_eos": True},
    ),
    "stream_logprobs": (
        "/v1/chat/completions",
        lambda: {
            "messages": HI,
            "logprobs": True,
            "top_logprobs": 20,
            "n": 8,
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        },
    ),
    "many_prompts": ("/v1/completions", lambda: {"prompt": ["hi"] * 1024, "max_tokens": 1}),
    "tools": (
        "/v1/chat/completions",
        lambda: {
            "messages": HI,
            "max_tokens": 1,
            "tool_choice": "required",
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": f"f{i}",
                        "parameters": {
                            "type": "object",
                            "properties": {f"p{j}": {"type": "string"} for j in range(20)},
                        },
                    },
                }
                for i in range(300)
            ],
        },
    ),
    "big_schema": (
        "/v1/chat/completions",
        lambda: {
            "messages": HI,
            "max_tokens": 1,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {
                            f"p{j}": {"type": "object", "properties": {f"q{k}": {"type": "integer"} for k in range(30)}}
                            for j in range(2000)
                        },
                    },
                },
            },
        },
    ),
    "stop_strings": (
        "/v1/chat/completions",
        lambda: {
            "messages": HI,
            "max_tokens": 2000,
            "ignore_eos": True,
            "n": 8,
            "stop": ["z" * 990 + str(i) for i in range(64)],
        },
    ),
    "sandbox_parts": (
        "/v1/chat/completions",
        lambda: {
            "messages": text_parts(100_000),
            "max_tokens": 1,
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
        },
    ),
    "long_text": (
        "/v1/chat/completions",
        lambda: {"messages": [{"role": "user", "content": "x " * 20_000_000}], "max_tokens": 1},
    ),
    "detokenize": ("/detokenize", lambda: {"tokens": [random.randrange(1000, VOCAB) for _ in range(8192)]}),
    "tokenize_long": ("/tokenize", lambda: {"prompt": "hello " * 5_000_000}),
    "logit_bias": (
        "/v1/chat/completions",
        lambda: {
            "messages": HI,
            "max_tokens": 500,
            "ignore_eos": True,
            "n": 8,
            "logit_bias": {str(i): 1.0 for i in range(1000, 2024)},
        },
    ),
    "big_images": (
        "/v1/chat/completions",
        lambda: {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": big_jpeg()}}] * 3
                    + [{"type": "text", "text": "hi"}],
                }
            ],
            "max_tokens": 1,
            "mm_processor_kwargs": {"max_pixels": 200000},
        },
    ),
}


def post(base: str, path: str, body: bytes) -> tuple[int, float, bytes]:
    request = urllib.request.Request(base + path, data=body, headers={"content-type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, time.perf_counter() - start, response.read()
    except urllib.error.HTTPError as error:
        return error.code, time.perf_counter() - start, error.read()


def probe(base: str, name: str, copies: int) -> str:
    path, build = PROBES[name]
    body = json.dumps(build()).encode()  # encoded before timing: the client's own GIL must not skew it
    plain_body = json.dumps(PLAIN).encode()
    results, health_max, plain = [], [0.0], []
    done = threading.Event()

    def poll_health():
        while not done.is_set():
            start = time.perf_counter()
            urllib.request.urlopen(base + "/health", timeout=60).read()
            health_max[0] = max(health_max[0], time.perf_counter() - start)
            time.sleep(0.02)

    def plain_chats():
        while not done.is_set():
            plain.append(post(base, "/v1/chat/completions", plain_body)[1])
            time.sleep(0.1)

    senders = [threading.Thread(target=lambda: results.append(post(base, path, body))) for _ in range(copies)]
    watchers = [threading.Thread(target=poll_health), threading.Thread(target=plain_chats)]
    for thread in watchers:
        thread.start()
    start = time.perf_counter()
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    wall = time.perf_counter() - start
    done.set()
    for thread in watchers:
        thread.join()
    statuses = sorted({status for status, _, _ in results})
    return (
        f"{name:16s} k={copies} statuses={statuses} wall={wall:6.2f} s health_max={health_max[0] * 1000:6.0f} ms "
        f"plain_max={max(plain or [0]) * 1000:7.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8123")
    parser.add_argument("-k", "--copies", type=int, default=2, help="copies of the probe sent at once")
    parser.add_argument("probes", nargs="*", help=f"default: all of {', '.join(PROBES)}")
    args = parser.parse_args()
    unknown = set(args.probes) - set(PROBES)
    if unknown:
        parser.error(f"unknown probes {sorted(unknown)}; known: {', '.join(PROBES)}")
    for name in args.probes or PROBES:
        print(probe(args.base_url.rstrip("/"), name, args.copies), flush=True)


if __name__ == "__main__":
    main()
