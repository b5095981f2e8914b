"""The HTTP front end: OpenAI routes over an AsyncLLM, API key check, OpenAI-shaped errors.

A request's path: body size check -> API key -> route -> body validated (pydantic) -> sampling params -> remote
images fetched under the media policy (worker thread) -> AsyncLLM.generate (templating, tokenization and image
preprocessing in a worker thread, then the engine process) -> response or SSE stream (openai_serving).
Errors become OpenAI-shaped bodies: 400 bad input, 401 key, 404 model, 413 too large, 500 a bug, 503 engine down.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fovea import __version__
from fovea.engine.async_engine import AsyncLLM, EngineDeadError
from fovea.engine.sampling_params import generation_config_defaults
from fovea.server import openai_serving as serving
from fovea.multimodal.image import ImageTooLarge
from fovea.server.guards import APIKeyCheck, BodyLimit
from fovea.server.media import MediaPolicy, fetch_media
from fovea.server.metrics import ServerMetrics
from fovea.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                   error_body)

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass
class ServerOptions:
    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    chat_template: str | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    max_body_bytes: int = 64 << 20


class ClientDisconnected(Exception):
    pass


async def unless_disconnected(request: Request, awaitable):
    """Awaits `awaitable`, unless the client leaves first: then it is cancelled, which aborts its request."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():  # the client left, or this handler itself was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let the request's generator abort and close


def build_app(engine: AsyncLLM, options: ServerOptions) -> FastAPI:
    app = FastAPI(title="fovea", version=__version__)
    names = options.served_model_names or [str(engine.config.model_dir)]
    defaults = generation_config_defaults(engine.config.model_dir)
    image_limit = engine.config.limit_mm_per_prompt.get("image")
    started = int(time.time())
    metrics = ServerMetrics(names[0])
    metrics.update(engine.stats)
    engine.on_stats = metrics.update

    def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, status, param), status_code=status)

    @app.exception_handler(APIError)
    async def on_api_error(_, exc: APIError):
        return error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else str(exc),
                     "BadRequestError", where or None)

    @app.exception_handler(ValueError)
    async def on_value_error(_, exc: ValueError):
        return error(400, str(exc), "BadRequestError")

    @app.exception_handler(ImageTooLarge)
    async def on_image_too_large(_, exc: ImageTooLarge):
        return error(413, str(exc), "RequestEntityTooLargeError")

    @app.exception_handler(EngineDeadError)
    async def on_dead(_, exc: EngineDeadError):
        return error(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(ClientDisconnected)
    async def on_disconnected(_, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; the request is already aborted

    @app.exception_handler(Exception)
    async def on_unexpected(_, exc: Exception):
        # a bug hit while handling this request: it fails alone (uvicorn logs the traceback), the server goes on
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")

    app.add_middleware(BodyLimit, max_bytes=options.max_body_bytes)
    app.add_middleware(APIKeyCheck, api_key=options.api_key)  # added last: runs first

    def model_name(requested: str | None) -> str:
        if requested is None or requested in names:
            return requested or names[0]
        raise APIError(404, f"The model `{requested}` does not exist.", "NotFoundError", "model")

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return error(503, f"engine stopped: {engine.error}", "ServiceUnavailableError")
        return JSONResponse({})

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "fovea",
             "root": str(engine.config.model_dir), "max_model_len": engine.config.max_model_len}
            for name in names]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model = model_name(body.model)
        params = body.to_sampling_params(defaults)
        messages = await asyncio.to_thread(fetch_media, body.messages, options.media, image_limit)
        request_id = serving.new_id("chatcmpl")
        stream = engine.generate(messages=messages, sampling_params=params, request_id=request_id,
                                 mm_processor_kwargs=body.mm_processor_kwargs,
                                 chat_template=body.chat_template or options.chat_template)
        first = await unless_disconnected(request, anext(stream))  # bad input fails here, before any 200
        top = body.top_logprobs or 0
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(serving.chat_stream(first, stream, model, request_id, body.n, top,
                                                         include_usage), media_type="text/event-stream")
        await stream.aclose()
        return serving.chat_response(first, model, request_id, top)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        model = model_name(body.model)
        params = body.to_sampling_params(defaults)
        request_id = serving.new_id("cmpl")
        prompts = body.prompts()
        merged = serving.merge([engine.generate(prompt=p, sampling_params=params, request_id=f"{request_id}-{i}",
                                                mm_processor_kwargs=body.mm_processor_kwargs)
                                for i, p in enumerate(prompts)])
        first = await unless_disconnected(request, anext(merged))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(serving.completion_stream(first, merged, model, request_id, body.n, body.logprobs,
                                                               include_usage), media_type="text/event-stream")
        try:
            return await unless_disconnected(request, serving.completion_response(
                first, merged, len(prompts), model, request_id, body.n, body.echo, body.logprobs))
        finally:
            await merged.aclose()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        inputs = engine.inputs
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages")
        if body.messages is not None:
            messages = await asyncio.to_thread(fetch_media, body.messages, options.media, image_limit)
            processed = await asyncio.to_thread(inputs.process_chat, messages,
                                                add_generation_prompt=body.add_generation_prompt)
            tokens = processed.token_ids
        else:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        vocab = engine.config.model.text.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return app
