"""Bad input, dropped clients and /metrics on a real server: every bad request gets its status and a message
that names the problem, in OpenAI's error shape, and the server goes on serving; dropped clients free their KV."""

from __future__ import annotations

import base64
import json
import struct
import time
import zlib

import httpx
import pytest
from conftest import jpeg_bytes, random_image
from serving import metric, running_server

KEY = "sk-errors"
AUTH = {"Authorization": f"Bearer {KEY}"}


def png(width: int, height: int, idat: bytes = b"\x00") -> bytes:
    """A PNG whose header claims width x height (the pixel data may be missing: it is never decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(idat))
        + chunk(b"IEND", b"")
    )


def data_url(raw: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def chat_with(*parts, **fields) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": list(parts)}], **fields}


def image(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "What is it?"}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("allowed")
    good = jpeg_bytes(random_image(120, 90, 3))
    (root / "ok.jpg").write_bytes(good)
    outside = tmp_path_factory.mktemp("outside") / "secret.jpg"
    outside.write_bytes(good)
    return {"root": root, "good": good, "outside": outside}


@pytest.fixture(scope="module")
def server(tiny_dirs, media):
    with running_server(
        tiny_dirs["tiny-3b"],
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--num-gpu-blocks-override",
        "200",
        "--served-model-name",
        "tiny",
        "--api-key",
        KEY,
        "--allowed-local-media-path",
        str(media["root"]),
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--max-request-body-mb",
        "1",
    ) as (base, proc):
        yield base
    assert proc.returncode == 0, proc.output
    assert "Traceback" not in proc.output, proc.output  # bad input and dropped clients are not server errors


def bad_inputs(media) -> list[tuple[str, str, dict | bytes, int, str]]:
    """(name, path, body, status, what the message must say)."""
    good = data_url(media["good"], "jpeg")
    chat, completions = "/v1/chat/completions", "/v1/completions"
    return [
        ("no messages", chat, {"model": "tiny"}, 400, "messages"),
        ("empty messages", chat, {"model": "tiny", "messages": []}, 400, "messages"),
        ("negative temperature", chat, {"model": "tiny", "messages": HELLO, "temperature": -1}, 400, "temperature"),
        ("top_p over 1", chat, {"model": "tiny", "messages": HELLO, "top_p": 1.5}, 400, "top_p"),
        ("n = 0", chat, {"model": "tiny", "messages": HELLO, "n": 0}, 400, "n must be"),
        ("max_tokens = 0", chat, {"model": "tiny", "messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
        (
            "too many top_logprobs",
            chat,
            {"model": "tiny", "messages": HELLO, "logprobs": True, "top_logprobs": 50},
            400,
            "logprobs",
        ),
        (
            "top_logprobs without logprobs",
            chat,
            {"model": "tiny", "messages": HELLO, "top_logprobs": 2},
            400,
            "requires logprobs",
        ),
        (
            "logit_bias key not a token id",
            chat,
            {"model": "tiny", "messages": HELLO, "logit_bias": {"x": 1}},
            400,
            "logit_bias",
        ),
        ("unknown model", chat, {"model": "gpt-4", "messages": HELLO}, 404, "does not exist"),
        (
            "unsupported part type",
            chat,
            chat_with({"type": "audio_url", "audio_url": {"url": "x"}}),
            400,
            "unsupported content part type",
        ),
        ("image url not a string", chat, chat_with(image(42), TEXT), 400, "non-empty string"),
        ("ftp url", chat, chat_with(image("ftp://example.com/a.png"), TEXT), 400, "must be a data:"),
        (
            "file outside the allowed path",
            chat,
            chat_with(image(f"file://{media['outside']}"), TEXT),
            400,
            "outside the folder the server allows",
        ),
        (
            "file url escaping with %2e%2e",
            chat,  # the check must see the path the loader opens
            chat_with(image(f"file://{media['root']}/%2e%2e/{media['outside'].parent.name}/secret.jpg"), TEXT),
            400,
            "outside the folder the server allows",
        ),
        ("loopback http url", chat, chat_with(image("http://127.0.0.1:9/a.png"), TEXT), 400, "non-public address"),
        (
            "link-local http url",
            chat,
            chat_with(image("http://169.254.169.254/latest"), TEXT),
            400,
            "non-public address",
        ),
        ("invalid base64", chat, chat_with(image("data:image/png;base64,@@@"), TEXT), 400, "invalid base64"),
        ("not an image", chat, chat_with(image(data_url(b"hello world")), TEXT), 400, "not a readable image"),
        (
            "truncated jpeg",
            chat,
            chat_with(image(data_url(media["good"][: len(media["good"]) // 2], "jpeg")), TEXT),
            400,
            "not a readable image",
        ),
        ("0-pixel image", chat, chat_with(image(data_url(png(0, 16))), TEXT), 400, "not a readable image"),
        (
            "an EPS image (Ghostscript's format)",
            chat,
            chat_with(image(data_url(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n", "eps")), TEXT),
            400,
            "in a supported format (JPEG, PNG, WEBP, GIF, BMP, TIFF)",
        ),
        (
            "NaN in a video kwarg",
            chat,
            json.dumps({**chat_with(TEXT), "mm_processor_kwargs": {"max_frames": float("nan")}}).encode(),
            400,
            "must be a positive finite number",
        ),  # JSON's NaN, as a client can send it
        (
            "extreme aspect ratio",
            chat,
            chat_with(image(data_url(png(4000, 4, b"\x00" * (4000 * 3 + 1) * 4))), TEXT),
            400,
            "aspect ratio",
        ),
        ("decompression bomb", chat, chat_with(image(data_url(png(40000, 40000))), TEXT), 413, "pixels"),
        (
            "more images than --limit-mm-per-prompt",
            chat,
            chat_with(image(good), image(good), image(good), TEXT),
            400,
            "limit_mm_per_prompt",
        ),
        (
            "unknown mm_processor_kwargs",
            chat,
            chat_with(image(good), TEXT, mm_processor_kwargs={"size": 3}),
            400,
            "unsupported mm_processor_kwargs",
        ),
        (
            "unknown mm_processor_kwargs, no image",
            chat,
            chat_with(TEXT, mm_processor_kwargs={"size": 3}),
            400,
            "unsupported mm_processor_kwargs",
        ),
        (
            "request chat template without the trust flag",
            chat,
            {"model": "tiny", "messages": HELLO, "chat_template": "{{ messages }}"},
            400,
            "--trust-request-chat-template",
        ),
        # one request must never kill the engine: everything is checked at admission
        ("n above max_num_seqs", chat, {"model": "tiny", "messages": HELLO, "n": 257}, 400, "max_num_seqs"),
        (
            "n above max_num_seqs (completions)",
            completions,
            {"model": "tiny", "prompt": "hi", "n": 257},
            400,
            "max_num_seqs",
        ),
        ("top_k beyond int64", chat, {"model": "tiny", "messages": HELLO, "top_k": 10**20}, 400, "64-bit"),
        ("seed beyond int64", chat, {"model": "tiny", "messages": HELLO, "seed": 2**64}, 400, "seed"),
        (
            "stop_token_ids out of vocabulary",
            chat,
            {"model": "tiny", "messages": HELLO, "temperature": 0, "stop_token_ids": [1000000], "min_tokens": 2},
            400,
            "stop_token_ids has token id 1000000",
        ),
        (
            "logit_bias id out of vocabulary",
            chat,
            {"model": "tiny", "messages": HELLO, "logit_bias": {"1000000": 1}},
            400,
            "logit_bias has token id",
        ),
        # cheap rejections: a 12-megapixel photo over max_model_len is refused from its header alone (this PNG
        # holds no pixel data: decoding it would fail), as are mm_processor_kwargs beyond the server's max_pixels
        (
            "12 MP photo longer than max_model_len",
            chat,
            chat_with(image(data_url(png(4000, 3000))), TEXT),
            400,
            "maximum model length",
        ),
        (
            "min_pixels blow-up on a 1x1 image",
            chat,
            chat_with(image(data_url(png(1, 1, b"\x00" * 4))), TEXT, mm_processor_kwargs={"min_pixels": 40_000_000}),
            400,
            "maximum model length",
        ),
        (
            "max_pixels 1e12 on an 8192x8192 image",
            chat,
            chat_with(image(data_url(png(8192, 8192))), TEXT, mm_processor_kwargs={"max_pixels": 10**12}),
            400,
            "maximum model length",
        ),
        (
            "text beyond the character bound",
            chat,
            {"model": "tiny", "messages": [{"role": "user", "content": "x" * 70_000}]},
            400,
            "(length at least",
        ),
        (
            "tokenize beyond the character bound",
            "/tokenize",
            {"model": "tiny", "prompt": "x" * 70_000},
            400,
            "maximum model length",
        ),
        ("non-string role", chat, {"model": "tiny", "messages": [{"role": 5, "content": "hi"}]}, 400, "role"),
        ("non-string text part", chat, chat_with({"type": "text", "text": 5}), 400, "'text' must be a string"),
        (
            "lone surrogate",
            chat,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
            400,
            "surrogate",
        ),
        (
            "NaN logit_bias",
            chat,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": NaN}}',
            400,
            "finite",
        ),
        (
            "infinite temperature",
            chat,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
            400,
            "finite",
        ),
        (
            "too many stop strings",
            chat,
            {"model": "tiny", "messages": HELLO, "stop": [str(i) for i in range(65)]},
            400,
            "at most 64",
        ),
        ("stop string too long", chat, {"model": "tiny", "messages": HELLO, "stop": ["x" * 1001]}, 400, "characters"),
        (
            "too many stop_token_ids",
            chat,
            {"model": "tiny", "messages": HELLO, "stop_token_ids": list(range(1025))},
            400,
            "at most 1024",
        ),
        ("too many prompts", completions, {"model": "tiny", "prompt": ["a"] * 1025}, 400, "at most 1024"),
        (
            "carrier-grade NAT address (cloud metadata)",
            chat,
            chat_with(image("http://100.100.100.200/latest"), TEXT),
            400,
            "non-public address",
        ),
        (
            "IPv4-mapped loopback",
            chat,
            chat_with(image("http://[::ffff:127.0.0.1]:9/a.png"), TEXT),
            400,
            "non-public address",
        ),
        ("6to4 loopback", chat, chat_with(image("http://[2002:7f00:1::]:9/a.png"), TEXT), 400, "non-public address"),
        (
            "detokenize more than max_model_len ids",
            "/detokenize",
            {"model": "tiny", "tokens": [1] * 513},
            400,
            "max_model_len",
        ),
        (
            "body with more JSON objects than FOVEA_MAX_BODY_OBJECTS",
            chat,
            {"model": "tiny", "messages": HELLO, "pad": [[]] * 100_001},
            413,
            "more than 100000 JSON objects",
        ),
        (
            "body over --max-request-body-mb",
            chat,
            {"model": "tiny", "messages": HELLO, "pad": "x" * (1 << 20)},
            413,
            "larger than",
        ),
        (
            "prompt longer than max_model_len",
            completions,
            {"model": "tiny", "prompt": list(range(1, 600))},
            400,
            "maximum model length",
        ),
        ("token id out of vocabulary", completions, {"model": "tiny", "prompt": [10**9]}, 400, "out of vocabulary"),
        ("empty prompt list", completions, {"model": "tiny", "prompt": []}, 400, "prompt"),
        ("suffix", completions, {"model": "tiny", "prompt": "a", "suffix": "b"}, 400, "suffix"),
        ("not JSON", chat, b"{not json", 400, "JSON"),
        (
            "tokenize under the media policy",
            "/tokenize",
            {"model": "tiny", "messages": [{"role": "user", "content": [image(f"file://{media['outside']}"), TEXT]}]},
            400,
            "outside the folder the server allows",
        ),
        ("detokenize bad id", "/detokenize", {"model": "tiny", "tokens": [-1]}, 400, "token ids must be"),
        ("tokenize with nothing", "/tokenize", {"model": "tiny"}, 400, "exactly one of prompt and messages"),
    ]


def test_bad_input_table(server, media):
    cases = bad_inputs(media)
    assert len(cases) >= 25
    failures = []
    for name, path, body, status, message in cases:
        kwargs = (
            {"content": body, "headers": {**AUTH, "content-type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body, "headers": AUTH}
        )
        response = httpx.post(server + path, timeout=60, **kwargs)
        error = response.json().get("error", {}) if response.headers.get("content-type") == "application/json" else {}
        if (
            response.status_code != status
            or message not in str(error.get("message"))
            or set(error) != {"message", "type", "param", "code"}
            or error.get("code") != status
        ):
            failures.append(f"{name}: {response.status_code} {response.text[:300]}")
        if ".py" in response.text or "Traceback" in response.text:  # no source paths, no tracebacks
            failures.append(f"{name} names source files: {response.text[:300]}")
        if " at 0x" in response.text or str(media["root"]) in response.text or "NaN to integer" in response.text:
            failures.append(f"{name} shows an object, a server path or an interpreter message: {response.text[:300]}")
    assert not failures, "\n".join(failures)
    for headers in ({}, {"Authorization": "Bearer wrong"}):  # every /v1 route, /tokenize and /detokenize want the key
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/completions"),
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
        ):
            response = httpx.request(method, server + path, headers=headers, json={})
            assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationError"
    for method, path, status in (("GET", "/v1/chat/completions", 405), ("POST", "/v1/nothing", 404)):
        error = httpx.request(method, server + path, headers=AUTH).json()["error"]
        assert error["code"] == status and error["type"] in ("MethodNotAllowedError", "NotFoundError"), error
    chunked = httpx.post(
        server + "/v1/chat/completions",
        headers=AUTH | {"content-type": "application/json"},  # no Content-Length: counted as it comes
        content=(b"x" * (1 << 16) for _ in range(20)),
    )
    assert chunked.status_code == 413
    still = httpx.post(
        server + "/v1/chat/completions", headers=AUTH, json=chat_with(image(data_url(media["good"])), TEXT), timeout=60
    )
    assert still.status_code == 200 and still.json()["choices"][0]["finish_reason"] == "length"


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_dropped_clients_free_their_kv_blocks(server):
    aborted = metric(server, 'fovea:request_success_total{finished_reason="abort",model_name="tiny"}')
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=AUTH) as client:
        streams = [client.stream("POST", server + "/v1/chat/completions", json=body) for _ in range(20)]
        responses = [s.__enter__() for s in streams]
        for response in responses:
            lines = response.iter_lines()
            while not next(lines).startswith('data: {"id"'):
                pass
            next(lines)
        assert metric(server, "fovea:kv_cache_used_blocks") > 0
        for stream in streams:  # each drops its connection mid-way
            stream.__exit__(None, None, None)
    # a non-streaming client that gives up is noticed too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server + "/v1/chat/completions",
            headers=AUTH,
            timeout=1.0,
            json={**body, "stream": False, "max_tokens": 500},
        )
    assert wait_for(
        lambda: metric(server, "fovea:kv_cache_used_blocks") == 0 and metric(server, "fovea:num_requests_running") == 0
    )
    assert metric(server, 'fovea:request_success_total{finished_reason="abort",model_name="tiny"}') == aborted + 21


def test_metrics_report_requests_latencies_and_caches(server):
    def value(name):
        return metric(server, name + '{model_name="tiny"}')

    before = {
        name: value(name)
        for name in (
            "fovea:prompt_tokens_total",
            "fovea:generation_tokens_total",
            "fovea:encoder_cache_queries_total",
            "fovea:encoder_cache_hits_total",
            "fovea:prefix_cache_queries_total",
            "fovea:prefix_cache_hits_total",
            "fovea:time_to_first_token_seconds_count",
            "fovea:e2e_request_latency_seconds_count",
            "fovea:inter_token_latency_seconds_count",
        )
    }
    stopped = metric(server, 'fovea:request_success_total{finished_reason="length",model_name="tiny"}')
    picture = image(data_url(jpeg_bytes(random_image(120, 90, 77)), "jpeg"))  # new to this server
    first = chat_with(picture, TEXT, max_tokens=5, ignore_eos=True)
    # the same prompt again: its prefix is cached; then the picture after other text: only the encoder cache helps
    other = chat_with({"type": "text", "text": "Look at this:"}, picture, max_tokens=5, ignore_eos=True)
    replies = [
        httpx.post(server + "/v1/chat/completions", headers=AUTH, json=body, timeout=60).json()["usage"]
        for body in (first, first, other)
    ]
    cached = replies[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    prompt_tokens = sum(r["prompt_tokens"] for r in replies)
    # the counters come with the engine's stats, which may follow the last answer in the next message: settled
    # once the third request's latency is counted (CI once read them between the two)
    latency = "fovea:e2e_request_latency_seconds_count"
    assert wait_for(lambda: value(latency) - before[latency] == 3, timeout=10)
    after = {name: value(name) for name in before}
    grew = {name: after[name] - before[name] for name in before}
    assert grew["fovea:prompt_tokens_total"] == prompt_tokens
    assert grew["fovea:generation_tokens_total"] == 15
    assert grew["fovea:time_to_first_token_seconds_count"] == 3
    assert grew["fovea:e2e_request_latency_seconds_count"] == 3
    assert grew["fovea:inter_token_latency_seconds_count"] == 12  # 4 gaps between 5 tokens, three times
    assert grew["fovea:prefix_cache_queries_total"] == prompt_tokens
    assert grew["fovea:prefix_cache_hits_total"] == sum(
        r.get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in replies
    )
    assert (grew["fovea:encoder_cache_queries_total"], grew["fovea:encoder_cache_hits_total"]) == (2, 1)
    assert metric(server, 'fovea:request_success_total{finished_reason="length",model_name="tiny"}') == stopped + 3
    assert 0 <= value("fovea:kv_cache_usage_perc") <= 1 and value("fovea:kv_cache_total_blocks") == 200
    assert value("fovea:num_requests_waiting") == 0


def test_logit_bias_is_clamped_to_openais_range():
    from fovea.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(messages=HELLO, logit_bias={"5": 1000, "6": -250.5, "7": 3})
    assert body.to_sampling_params({}).logit_bias == {5: 100.0, 6: -100.0, 7: 3.0}


def test_merged_prompts_end_with_the_failing_prompts_error_and_close_the_others():
    """A completions request's prompts run as streams merged into one; when one fails, the request ends with that
    error and every other stream is closed (its request aborted). Before, closing a stream whose pump was still
    waiting inside it raised "asynchronous generator is already running" (a 500 that hid the real error)."""
    import asyncio

    from fovea.server.openai_serving import merge

    closed = []

    async def failing():
        yield "first"
        await asyncio.sleep(0.01)
        raise ValueError("the grammar broke")

    async def waiting(name):
        try:
            yield name
            await asyncio.sleep(60)  # still waiting here when the other fails
            yield "never"
        finally:
            closed.append(name)

    async def main():
        seen = []
        with pytest.raises(ValueError, match="the grammar broke"):
            async for index, item in merge([waiting("a"), failing(), waiting("b")]):
                seen.append((index, item))
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), 10))
    assert sorted(seen) == [(0, "a"), (1, "first"), (2, "b")]
    assert sorted(closed) == ["a", "b"]
