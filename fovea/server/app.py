"""The HTTP front end: OpenAI routes over an AsyncLLM, API key check, OpenAI-shaped errors.

A request's path: route -> body validated (pydantic) -> sampling params -> AsyncLLM.generate (templating and
images in a worker thread, then the engine thread) -> response or SSE stream (openai_serving).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from fovea import __version__
from fovea.engine.async_engine import AsyncLLM, EngineDeadError
from fovea.engine.sampling_params import generation_config_defaults
from fovea.server import openai_serving as serving
from fovea.server.media import MediaPolicy, check_media
from fovea.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                   error_body)


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


def build_app(engine: AsyncLLM, options: ServerOptions) -> FastAPI:
    app = FastAPI(title="fovea", version=__version__)
    names = options.served_model_names or [str(engine.engine.config.model_dir)]
    defaults = generation_config_defaults(engine.engine.config.model_dir)
    started = int(time.time())

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

    @app.exception_handler(EngineDeadError)
    async def on_dead(_, exc: EngineDeadError):
        return error(503, str(exc), "ServiceUnavailableError")

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if options.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {options.api_key}":
                return error(401, "invalid or missing API key", "AuthenticationError")
        return await call_next(request)

    def model_name(requested: str | None) -> str:
        if requested is None or requested in names:
            return requested or names[0]
        raise APIError(404, f"The model `{requested}` does not exist.", "NotFoundError", "model")

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return error(503, f"engine stopped: {engine.error!r}", "ServiceUnavailableError")
        return JSONResponse({})

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "fovea",
             "root": str(engine.engine.config.model_dir), "max_model_len": engine.engine.config.max_model_len}
            for name in names]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        model = model_name(body.model)
        check_media(body.messages, options.media)
        params = body.to_sampling_params(defaults)
        request_id = serving.new_id("chatcmpl")
        stream = engine.generate(messages=body.messages, sampling_params=params, request_id=request_id,
                                 mm_processor_kwargs=body.mm_processor_kwargs,
                                 chat_template=body.chat_template or options.chat_template)
        first = await anext(stream)  # bad input fails here, before any 200 is sent
        top = body.top_logprobs or 0
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(serving.chat_stream(first, stream, model, request_id, body.n, top,
                                                         include_usage), media_type="text/event-stream")
        await stream.aclose()
        return serving.chat_response(first, model, request_id, top)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        model = model_name(body.model)
        params = body.to_sampling_params(defaults)
        request_id = serving.new_id("cmpl")
        prompts = body.prompts()
        streams = [engine.generate(prompt=p, sampling_params=params, request_id=f"{request_id}-{i}",
                                   mm_processor_kwargs=body.mm_processor_kwargs) for i, p in enumerate(prompts)]
        merged = serving.merge(streams)
        first = await anext(merged)
        if body.stream:
            return StreamingResponse(completion_stream(first, merged, model, request_id, body),
                                     media_type="text/event-stream")
        finals: dict[int, object] = {}
        index, output = first
        while True:
            finals[index] = output
            if len(finals) == len(prompts):
                break
            index, output = await anext(merged)
        await merged.aclose()
        usage = serving.Usage()
        choices = []
        for i in range(len(prompts)):
            output = finals[i]
            usage.add_prompt(output)
            echo = output.prompt if body.echo else None
            for c in output.outputs:
                usage.completion_tokens += len(c.token_ids)
                choices.append(serving.completion_choice(output, c, i * body.n + c.index, echo, body.logprobs))
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.as_dict()}

    async def completion_stream(first, merged, model, request_id, body):
        usage = serving.Usage()
        created = int(time.time())
        try:
            item = first
            while item is not None:
                index, output = item
                for c in output.outputs:
                    usage.completion_tokens += len(c.token_ids)
                    if c.text or c.finish_reason:
                        yield serving.sse({"id": request_id, "object": "text_completion", "created": created,
                                           "model": model, "choices": [serving.completion_choice(
                                               output, c, index * body.n + c.index, None, body.logprobs)]})
                if output.finished:
                    usage.add_prompt(output)
                item = await anext(merged, None)
            if body.stream_options and body.stream_options.include_usage:
                yield serving.sse({"id": request_id, "object": "text_completion", "created": created,
                                   "model": model, "choices": [], "usage": usage.as_dict()})
            yield serving.sse("[DONE]")
        finally:
            await merged.aclose()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        inputs = engine.engine.inputs
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages")
        if body.messages is not None:
            processed = inputs.process_chat(body.messages, add_generation_prompt=body.add_generation_prompt)
            tokens = processed.token_ids
        else:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.engine.config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        vocab = engine.engine.config.model.text.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return app
