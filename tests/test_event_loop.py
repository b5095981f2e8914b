"""Work that grows with a request stays off the server's event loop (issue 30.5). A py-spy sweep of `fovea serve`
under large but legal requests found three places where one request's CPU work held everyone up: building and
encoding a whole response (8 choices x 1000 tokens x 20 top logprobs stalled /health 6.9 s, now 0.55 s), parsing a
body of two million small JSON objects (1.6 s, whichever thread parses: now refused from its byte count of
objects), and the tool list, sampling checks and request-template preparation (tens of ms per large body). Each
test here records which thread ran each piece: on the event loop is a failure, however fast the machine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from fovea.frontend.async_llm import AsyncLLM
from fovea.server import openai_serving, routes
from fovea.server.app import ServerOptions, build_app
from fovea.server.protocol import ChatCompletionRequest, CompletionRequest

OPTIONS = dict(dtype="float32", max_model_len=1024, num_gpu_blocks_override=200, mm_processor_workers=0)
HELLO = [{"role": "user", "content": "hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {"name": f"tool_{i}", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
    for i in range(3)
]


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    engine = AsyncLLM.from_args(str(tiny_dirs["tiny-3b"]), **OPTIONS)
    yield engine
    engine.shutdown()


def on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def record_threads(monkeypatch, places: dict) -> dict[str, list[bool]]:
    """Wraps each `name: (owner, attribute)` so that every call notes whether it ran on the event loop."""
    seen: dict[str, list[bool]] = {name: [] for name in places}
    for name, (owner, attribute) in places.items():
        original = getattr(owner, attribute)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            seen[_name].append(on_event_loop())
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, attribute, wrapper)
    return seen


def send_all(app, requests: list[tuple[str, dict | bytes]]) -> list[httpx.Response]:
    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fovea", timeout=120) as client:
            return [
                await client.post(
                    path,
                    **(
                        {"content": body, "headers": {"content-type": "application/json"}}
                        if isinstance(body, bytes)
                        else {"json": body}
                    ),
                )
                for path, body in requests
            ]

    return asyncio.run(main())


def test_bodies_parameters_templates_and_responses_are_built_off_the_event_loop(engine, monkeypatch):
    seen = record_threads(
        monkeypatch,
        {
            "parse the body": (routes, "parse_body"),
            "list the tools": (routes, "tool_list"),
            "chat sampling parameters": (ChatCompletionRequest, "to_sampling_params"),
            "completion sampling parameters": (CompletionRequest, "to_sampling_params"),
            "normalize a chat for a request's template": (engine.inputs.prompts, "normalize_chat"),
            "build a chat response": (openai_serving, "chat_response"),
            "build a completion response": (openai_serving, "completion_response"),
        },
    )
    app = build_app(engine, ServerOptions(["tiny"], trust_request_chat_template=True))
    try:
        template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        replies = send_all(
            app,
            [
                (
                    "/v1/chat/completions",
                    {
                        "messages": HELLO,
                        "max_tokens": 4,
                        "n": 2,
                        "logprobs": True,
                        "top_logprobs": 5,
                        "tools": TOOLS,
                        "tool_choice": "none",
                    },
                ),
                ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "chat_template": template}),
                ("/v1/completions", {"prompt": ["one", "two"], "max_tokens": 3, "echo": True, "logprobs": 2}),
                ("/tokenize", {"prompt": "hi there"}),
                ("/detokenize", {"tokens": [1, 2, 3]}),
            ],
        )
    finally:
        app.state.template_sandbox.close()
    assert [reply.status_code for reply in replies] == [200] * 5, [reply.text[:300] for reply in replies]
    chat, _, completion = (reply.json() for reply in replies[:3])
    assert len(chat["choices"]) == 2 and len(chat["choices"][0]["logprobs"]["content"]) == 4
    assert len(completion["choices"]) == 2 and completion["choices"][1]["text"].startswith("two")
    assert (
        len(completion["choices"][0]["logprobs"]["top_logprobs"])
        == len(completion["choices"][0]["logprobs"]["tokens"])
        > 3
    )  # echoed prompt tokens and the completion's
    assert all(seen.values()), {name: calls for name, calls in seen.items() if not calls}
    on_loop = [name for name, calls in seen.items() if any(calls)]
    assert not on_loop, f"ran on the event loop: {on_loop}"


def test_bodies_with_too_many_json_objects_are_refused_before_parsing(engine):
    """The object count is read off the bytes as they arrive (JSON parsing holds the GIL in any thread); the
    refused client hears a 413 even mid-upload, and the next request is served."""
    app = build_app(engine, ServerOptions(["tiny"], max_body_objects=1000))
    part = {"type": "text", "text": "a"}
    near = {"messages": [{"role": "user", "content": [part] * 990}], "max_tokens": 1}
    over = {"messages": [{"role": "user", "content": [part] * 1000}], "max_tokens": 1}

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fovea", timeout=120) as client:
            data = json.dumps(over).encode()

            async def chunks():  # no Content-Length: counted as it comes
                for i in range(0, len(data), 4096):
                    yield data[i : i + 4096]

            return [
                await client.post("/v1/chat/completions", json=over),
                await client.post(
                    "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
                ),
                await client.post("/v1/chat/completions", json=near),
                await client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}),
            ]

    refused, refused_chunked, near_limit, fine = asyncio.run(main())
    for reply in (refused, refused_chunked):
        error = reply.json()["error"]
        assert reply.status_code == 413 and error["type"] == "RequestEntityTooLargeError", reply.text
        assert "more than 1000 JSON objects and arrays (FOVEA_MAX_BODY_OBJECTS" in error["message"]
    assert near_limit.status_code == 200, near_limit.text
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 2


def test_a_chat_with_an_inline_image_is_prepared_in_one_pool_job(engine, monkeypatch):
    """Body, parameters, template, tokens and image in one preparation job (issue 54: the pool round trips were
    three); a remote image still waits for its download between two jobs. The other job is the response."""
    import base64
    import threading

    from conftest import jpeg_bytes, random_image

    threads: dict[str, set[int]] = {"parse": set(), "params": set(), "prepare": set()}
    jobs = []

    def note(name, original):
        return lambda *args, **kwargs: threads[name].add(threading.get_ident()) or original(*args, **kwargs)

    monkeypatch.setattr(routes, "parse_body", note("parse", routes.parse_body))
    monkeypatch.setattr(routes.Served, "chat_params", note("params", routes.Served.chat_params))
    monkeypatch.setattr(engine, "make_request", note("prepare", engine.make_request))
    run_in_pool = engine.run_in_pool
    monkeypatch.setattr(engine, "run_in_pool", lambda fn, *args: jobs.append(fn) or run_in_pool(fn, *args))
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg_bytes(random_image(64, 48, seed=1))).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0}
    (reply,) = send_all(build_app(engine, ServerOptions(["tiny"])), [("/v1/chat/completions", body)])
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["usage"]["prompt_tokens"] > 20  # the image's placeholders are in the prompt
    assert len(jobs) == 2  # the preparation, then the response
    (thread,) = threads["parse"]
    assert threads == {"parse": {thread}, "params": {thread}, "prepare": {thread}}
    assert thread != threading.get_ident()
