"""The async core: concurrent streams, requests added while the engine runs, early exits abort and free."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import random_image
from test_engine_vs_hf import LOREM

from fovea import LLM, SamplingParams
from fovea.core.messages import RequestsFailed
from fovea.core.sampling_params import RequestOutputKind
from fovea.frontend.async_llm import AsyncLLM, EngineDeadError

OPTIONS = dict(dtype="float32", max_model_len=2048, num_gpu_blocks_override=300, max_num_batched_tokens=128)
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


async def collect(engine, request_id, stop_after=None, **request):
    tokens, chunks, reason = [], 0, None
    async for out in engine.generate(sampling_params=PARAMS, request_id=request_id, **request):
        tokens += out.outputs[0].token_ids
        chunks += 1
        reason = out.outputs[0].finish_reason
        if stop_after and len(tokens) >= stop_after:
            break
    return tokens, chunks, reason


def test_streams_run_concurrently_and_abort_on_early_exit(tiny_dirs):
    model = str(tiny_dirs["tiny-3b"])
    image_chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": random_image(300, 200, 40)},
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]
    engine = AsyncLLM.from_args(model, **OPTIONS)

    async def main():
        first = asyncio.create_task(collect(engine, "a", prompt=LOREM * 3))
        await asyncio.sleep(0.2)  # the engine is busy with "a" when the others arrive
        leaving = asyncio.create_task(collect(engine, "b", stop_after=4, prompt=LOREM))
        third = asyncio.create_task(collect(engine, "c", messages=image_chat))
        with pytest.raises(ValueError, match="a prompt must be"):
            async for _ in engine.generate(prompt=123):
                pass
        return await asyncio.gather(first, leaving, third)

    try:
        (a, a_chunks, a_reason), (b, _, _), (c, _, c_reason) = asyncio.run(main())
        deadline = time.time() + 10
        while engine.stats.num_running and time.time() < deadline:  # the engine process applies b's abort
            time.sleep(0.01)
        assert (engine.stats.num_running, engine.stats.num_waiting, engine.stats.kv_used_blocks) == (0, 0, 0)
    finally:
        engine.shutdown()
    assert a_reason == c_reason == "length" and len(a) == len(c) == 20 and a_chunks > 1
    reference = LLM(model, **OPTIONS)
    greedy = PARAMS.clone(output_kind=RequestOutputKind.CUMULATIVE)
    assert a == reference.generate(LOREM * 3, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert b == reference.generate(LOREM, greedy, use_tqdm=False)[0].outputs[0].token_ids[: len(b)]
    assert c == reference.chat(image_chat, greedy, use_tqdm=False)[0].outputs[0].token_ids


def test_a_failing_request_fails_alone(tiny_dirs, monkeypatch):
    """A bug hit while preparing one request or building its response (here: injected exceptions) or a request
    the engine refuses fails that request only; the server answers 500 / 400 for it and the other streams are
    unaffected. A ValueError while building a response is the server's failure, not the request's (a 500)."""
    import httpx

    from fovea.server import openai_serving
    from fovea.server.app import ServerOptions, build_app

    engine = AsyncLLM.from_args(str(tiny_dirs["tiny-3b"]), **OPTIONS)
    process_chat = engine.inputs.process_chat
    chat_response = openai_serving.chat_response

    def faulty_body(output, *args):
        if len(output.outputs[0].token_ids) == 2:
            raise ValueError("injected body failure")
        return chat_response(output, *args)

    monkeypatch.setattr(openai_serving, "chat_response", faulty_body)

    def faulty(messages, *args, **kwargs):
        if messages[0]["content"] == "boom":
            raise RuntimeError("injected failure")
        return process_chat(messages, *args, **kwargs)

    engine.inputs.process_chat = faulty
    app = build_app(engine, ServerOptions(["tiny"]))

    async def main():
        running = asyncio.create_task(collect(engine, "long", prompt=LOREM))
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fovea") as client:

            def chat(text, **fields):
                return client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": text}], "max_tokens": 3, **fields},
                )

            broken, refused, fine, body = await asyncio.gather(
                chat("boom"), chat("hi", n=400), chat("hi"), chat("hi", max_tokens=2, ignore_eos=True)
            )
        return await running, broken, refused, fine, body

    async def engine_dies_and_comes_back():
        old_pid = engine.process.pid
        with pytest.raises(EngineDeadError, match="stopped unexpectedly"):
            async for _ in engine.generate(prompt=LOREM, sampling_params=PARAMS.clone(max_tokens=1000)):
                engine.process.kill()  # mid-stream
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fovea") as client:
            deadline = time.time() + 120
            while (await client.get("/health")).status_code != 200 and time.time() < deadline:
                await asyncio.sleep(0.2)  # 503 while the new engine starts
            reply = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        return engine.process.pid != old_pid, reply.status_code, reply.json()

    try:
        (tokens, _, reason), broken, refused, fine, body = asyncio.run(main())
        restarted, status, reply = asyncio.run(engine_dies_and_comes_back())
        assert restarted and status == 200 and reply["usage"]["completion_tokens"] == 3, reply
        assert engine.restarts[0] and engine.error is None
    finally:
        engine.shutdown()
    assert broken.status_code == 500 and "injected failure" in broken.json()["error"]["message"]
    assert refused.status_code == 400 and "max_num_seqs" in refused.json()["error"]["message"]
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 3
    assert body.status_code == 500 and "injected body failure" in body.json()["error"]["message"]
    assert reason == "length" and len(tokens) == 20


def test_a_request_the_engine_loses_fails_instead_of_waiting(tiny_dirs, monkeypatch):
    """A request the engine forgets (a bug; here the front end sends it under another id, which the engine runs
    and answers): its stream fails with an error instead of waiting until the client gives up, while the engine
    is still busy with a long request beside it (the engine reports the ids it holds every HELD_EVERY_S), which
    ends as usual."""
    import dataclasses

    from fovea.frontend.async_llm import RequestFailed

    engine = AsyncLLM.from_args(str(tiny_dirs["tiny-3b"]), **OPTIONS)
    process = engine._engines[0]
    real_add = process.add

    def add(request):
        if request.request_id == "lost":
            request = dataclasses.replace(request, request_id="renamed")
        return real_add(request)

    monkeypatch.setattr(process, "add", add)

    long = SamplingParams(temperature=0, max_tokens=1900, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run_long():
        tokens = []
        async for out in engine.generate(prompt="Hi", sampling_params=long, request_id="fine"):
            tokens += out.outputs[0].token_ids
        return tokens, out.outputs[0].finish_reason

    async def main():
        fine = asyncio.create_task(run_long())
        with pytest.raises(RequestFailed, match="the engine lost this request"):
            await asyncio.wait_for(collect(engine, "lost", prompt="Hello"), 60)
        assert not fine.done()  # told while the engine was busy, not once it went idle
        return await fine

    try:
        tokens, reason = asyncio.run(main())
    finally:
        engine.shutdown()
    assert reason == "length" and len(tokens) == 1900


def test_a_request_whose_output_cannot_be_made_fails_alone(tiny_dirs, monkeypatch):
    """Making one request's output fails in the front end (here: injected at its third report): its stream gets
    RequestFailed and the engine aborts it; the request beside it, whose reports came in the same messages, gets
    every token. (Before, the whole message's outputs were dropped: the other stream lost tokens or hung.)"""
    from fovea.frontend import outputs
    from fovea.frontend.async_llm import RequestFailed

    reports, assemble = {"doomed": 0}, outputs.OutputAssembler.__call__

    def faulty(self, delta):
        if delta.request_id == "doomed":
            reports["doomed"] += 1
            if reports["doomed"] == 3:
                raise KeyError("injected output failure")
        return assemble(self, delta)

    monkeypatch.setattr(outputs.OutputAssembler, "__call__", faulty)
    engine = AsyncLLM.from_args(str(tiny_dirs["tiny-3b"]), **OPTIONS)

    async def main():
        fine = asyncio.create_task(collect(engine, "fine", prompt=LOREM))
        with pytest.raises(RequestFailed, match="injected output failure"):
            await collect(engine, "doomed", prompt=LOREM * 2)
        return await asyncio.wait_for(fine, timeout=60)

    try:
        tokens, _, reason = asyncio.run(main())
        deadline = time.time() + 10
        while engine.stats.num_running and time.time() < deadline:  # the engine process applies the abort
            time.sleep(0.01)
        assert (engine.stats.num_running, engine.stats.kv_used_blocks) == (0, 0)
    finally:
        engine.shutdown()
    greedy = PARAMS.clone(output_kind=RequestOutputKind.CUMULATIVE)
    with LLM(str(tiny_dirs["tiny-3b"]), **OPTIONS) as reference:
        expected = reference.generate(LOREM, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert reason == "length" and tokens == expected


def test_an_engine_that_keeps_dying_is_given_up(tiny_dirs):
    """Past its restart budget the engine stays down: callers get 503 without a traceback, and on_fatal tells
    the server to exit (fovea serve then exits non-zero)."""
    import httpx

    from fovea.config.engine import EngineConfig
    from fovea.server.app import ServerOptions, build_app

    engine = AsyncLLM(EngineConfig.from_args(str(tiny_dirs["tiny-3b"]), **OPTIONS), max_restarts=0)
    fatal = []
    engine.on_fatal = lambda: fatal.append(True)
    app = build_app(engine, ServerOptions(["tiny"]))

    async def main():
        engine.process.kill()
        deadline = time.time() + 30
        while not fatal and time.time() < deadline:
            await asyncio.sleep(0.05)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fovea") as client:
            return await client.get("/health"), await client.post("/v1/completions", json={"prompt": "hi"})

    try:
        health, completion = asyncio.run(main())
    finally:
        engine.shutdown()
    assert fatal == [True]
    for response in (health, completion):
        assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
        assert "Traceback" not in response.text and ".py" not in response.text


def test_a_failed_request_ends_its_stream_with_an_error_event(tiny_dirs):
    """When the engine reports that a step failed for a request, a streaming client gets an OpenAI-shaped error
    event and [DONE] (not a cut connection), a waiting one a 500; the other requests go on."""
    import collections
    import json

    import httpx

    from fovea.server.app import ServerOptions, build_app

    engine = AsyncLLM.from_args(str(tiny_dirs["tiny-3b"]), **OPTIONS)
    app = build_app(engine, ServerOptions(["tiny"]))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "ignore_eos": True}

    delivered = collections.Counter()
    deliver_all = engine._deliver_all

    def counting_deliver_all(items):
        delivered.update(request_id for request_id, _ in items)
        deliver_all(items)

    engine._deliver_all = counting_deliver_all

    async def fail_the_newest_request(after_outputs=0):
        deadline = time.time() + 30
        while time.time() < deadline:
            fresh = [rid for rid in engine._streams if rid not in seen]
            if fresh:
                seen.update(fresh)
                while delivered[fresh[0]] < after_outputs and time.time() < deadline:  # tokens are streaming
                    await asyncio.sleep(0.005)
                engine._on_message(RequestsFailed(fresh, "RuntimeError: injected"))  # as engine_core sends it
                return
            await asyncio.sleep(0.005)

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fovea", timeout=60) as client:
            bystander = asyncio.create_task(collect(engine, "bystander", prompt=LOREM))
            await asyncio.sleep(0.2)
            seen.add("bystander")
            failing = asyncio.create_task(fail_the_newest_request(3))  # the transport hands over whole bodies
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            await failing
            waiting, _ = await asyncio.gather(client.post("/v1/chat/completions", json=body), fail_the_newest_request())
            return events, waiting, await bystander

    seen: set[str] = set()
    try:
        events, waiting, (tokens, _, reason) = asyncio.run(main())
    finally:
        engine.shutdown()
    error = json.loads(events[-2][6:])["error"]
    assert events[-1] == "data: [DONE]" and error["code"] == 500 and "injected" in error["message"], events[-3:]
    assert len(events) > 4 and all('"content"' in e for e in events[1:-2])  # it was streaming tokens
    assert waiting.status_code == 500 and "injected" in waiting.json()["error"]["message"]
    assert reason == "length" and len(tokens) == 20


def test_a_reader_that_falls_behind_gets_what_queued_as_one_output(tiny_dirs):
    """Outputs that queue while a stream's reader is busy (a server whose event loop falls behind at many
    streams) reach it as one: each sample's tokens, text and logprobs joined in order, the prompt with the first,
    the metrics with the last; an error queued behind outputs comes after them."""
    from fovea.frontend.async_llm import RequestFailed

    engine = AsyncLLM.from_args(str(tiny_dirs["tiny-3b"]), **OPTIONS)
    delta = RequestOutputKind.DELTA
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=40, ignore_eos=True, logprobs=1, output_kind=delta)

    async def slow_reader(request_id, max_tokens=40, fail=False):
        outputs, stream = [], engine.generate(LOREM, params.clone(max_tokens=max_tokens), request_id)
        try:
            async for output in stream:
                outputs.append(output)
                if len(outputs) == 1:
                    await asyncio.sleep(0.3)  # the engine runs on: its outputs queue
                    if fail:
                        engine._on_message(RequestsFailed([request_id], "injected"))
        except RequestFailed as error:
            return outputs, error
        return outputs, None

    async def main():
        slow = await slow_reader("slow")
        alone = [o async for o in engine.generate(LOREM, params.clone(output_kind=RequestOutputKind.FINAL_ONLY))]
        failing = await slow_reader("failing", max_tokens=1500, fail=True)
        return slow, alone, failing

    try:
        (outputs, error), (alone,), (before_error, failure) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert error is None and [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert max(len(c.token_ids) for c in outputs[1].outputs) > 1  # what queued came as one
    assert outputs[0].prompt_token_ids == alone.prompt_token_ids and outputs[-1].metrics is not None
    for c in alone.outputs:
        pieces = [s for o in outputs for s in o.outputs if s.index == c.index]
        assert [t for s in pieces for t in s.token_ids] == c.token_ids
        assert "".join(s.text for s in pieces) == c.text
        assert [e.keys() for s in pieces for e in s.logprobs] == [e.keys() for e in c.logprobs]
        assert pieces[-1].finish_reason == "length"
    assert isinstance(failure, RequestFailed) and len(before_error) == 2
    assert len(before_error[1].outputs[0].token_ids) > 1 and not before_error[1].finished


def test_a_steps_outputs_reach_their_streams_with_one_wake_up_per_event_loop():
    """The receiving thread hands a step's outputs to a caller's event loop in one call (one write to its wake-up
    socket, not one per stream), each in its own stream in order; streams of a closed loop are dropped."""
    import threading
    import types

    loop, closed = asyncio.new_event_loop(), asyncio.new_event_loop()
    closed.close()
    wake_ups = []
    wake = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *args: (wake_ups.append(args), wake(*args))[1]
    queues = {f"r{i}": asyncio.Queue() for i in range(3)}
    streams = {rid: (loop, q) for rid, q in queues.items()} | {"gone": (closed, asyncio.Queue())}
    owner = types.SimpleNamespace(_streams=streams, _sent_as={})
    items = [("r0", "a"), ("gone", "x"), ("r1", "b"), ("r0", "c"), ("unknown", "y"), ("r2", "d")]

    async def receive():
        thread = threading.Thread(target=AsyncLLM._deliver_all, args=(owner, items))
        thread.start()
        thread.join()
        return [[await q.get() for _ in range(q_len)] for q, q_len in zip(queues.values(), (2, 1, 1))]

    try:
        assert loop.run_until_complete(receive()) == [["a", "c"], ["b"], ["d"]]
    finally:
        loop.close()
    assert len(wake_ups) == 1 and "gone" not in streams


def test_mid_stream_only_the_engines_refusal_is_a_400(tiny_dirs, monkeypatch):
    """A stream that ends early says whose fault it was: the engine refusing the request while it runs (its own
    settings contradict each other) is a 400 event; a ValueError anywhere else, e.g. building a chunk, is the
    server's (500), not a 400 (the request was checked before its stream began)."""
    import json

    import httpx

    from fovea.core.messages import Rejected
    from fovea.server import openai_serving
    from fovea.server.app import ServerOptions, build_app

    engine = AsyncLLM.from_args(str(tiny_dirs["tiny-3b"]), **OPTIONS)
    app = build_app(engine, ServerOptions(["tiny"]))
    chat_logprobs = openai_serving.chat_logprobs
    built = []

    def failing_chunks(completion, *args):
        built.append(completion.logprobs is not None)
        if sum(built) == 3:  # the third chunk of the stream that asked for logprobs
            raise ValueError("injected chunk failure")
        return chat_logprobs(completion, *args)

    monkeypatch.setattr(openai_serving, "chat_logprobs", failing_chunks)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500, "ignore_eos": True, "stream": True}

    async def refuse_when_streaming():
        while not engine._streams:
            await asyncio.sleep(0.005)
        (request_id,) = engine._streams
        while not engine._assemblers[request_id].samples:  # tokens are streaming (1,500 are far off); before the
            await asyncio.sleep(0.005)  # first, a refusal is a plain 400 response, not an event (on a busy machine)
        engine._on_message(Rejected(request_id, "contradiction injected"))

    async def stream(client, fields):
        async with client.stream("POST", "/v1/chat/completions", json={**body, **fields}) as response:
            return [line async for line in response.aiter_lines() if line.startswith("data: ")]

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://fovea", timeout=60) as client:
            refused, _ = await asyncio.gather(stream(client, {}), refuse_when_streaming())
            broken = await stream(client, {"logprobs": True})
        return refused, broken

    try:
        refused, broken = asyncio.run(main())
    finally:
        engine.shutdown()
    for events, code, words in ((refused, 400, "contradiction injected"), (broken, 500, "injected chunk failure")):
        error = json.loads(events[-2][6:])["error"]
        assert events[-1] == "data: [DONE]" and error["code"] == code and words in error["message"], events[-3:]
